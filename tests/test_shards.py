"""Streaming shards and RecordIO sets: reading, packing, the per-rank/worker split, exact resume and bad input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, TINY, run_cli, shared_data
from tests.data_helpers import TREE_MODEL, jpeg_bytes, make_tree, write_shards
from tests.distributed_helpers import free_port, gpu_free_env
from vitrain.config import DataConfig, load_config
from vitrain.data.augment import BatchAugment
from vitrain.data.loader import TRACE_ENV, Position, runs_on_import
from vitrain.data.names import IndexNames
from vitrain.data.pipeline import build_loaders
from vitrain.data.shards import (
    ShardIndex,
    ShardWriter,
    load_index,
    read_index,
    read_samples,
    scan_index,
    shard_urls,
    write_index,
)
from vitrain.data.stream import Run, StreamLoader, StreamSet
from vitrain.engine.runs import class_names
from vitrain.errors import DataError
from vitrain.shard_names import expand_braces

TREE = [*TINY, *TREE_MODEL, "data.mean=[0.5,0.5,0.5]", "data.std=[0.5,0.5,0.5]"]


def _stream(urls: list[str], counts: list[int], **kw) -> StreamLoader:
    data = StreamSet(ShardIndex(urls, counts, ["a", "b"]), [Run(i, 0, c) for i, c in enumerate(counts)], 3, 8)
    args = {"batch_size": 4, "shuffle": True, "seed": 3, "window": 5, "prefetch": 0} | kw
    augment = BatchAugment(DataConfig(), 3, False, 8, 2)
    return StreamLoader(data, augment=augment, device=torch.device("cpu"), **args)


def _keys(loader, epoch: int = 0, start=None, trace: Path | None = None) -> list[list[str]]:
    trace = trace or Path(os.environ["PYTEST_TMP"]) / "trace.txt"
    trace.write_text("")
    os.environ[TRACE_ENV] = str(trace)
    try:
        for _ in loader.epoch(epoch, start):
            pass
    finally:
        del os.environ[TRACE_ENV]
    return [line.split()[1:] for line in trace.read_text().splitlines()]


@pytest.fixture(autouse=True)
def _tmp_env(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_TMP", str(tmp_path))


# ---------------------------------------------------------------------------------------------- reading


def test_brace_patterns_list_files_and_folders_name_the_samewrite_shards(tmp_path):
    assert expand_braces("a-{008..011}.tar") == ["a-008.tar", "a-009.tar", "a-010.tar", "a-011.tar"]
    assert expand_braces("{x,y}-{1..2}") == ["x-1", "x-2", "y-1", "y-2"]
    assert shard_urls("pipe:cat s-{0..1}.tar") == ["pipe:cat s-0.tar", "pipe:cat s-1.tar"]
    urls = write_shards(tmp_path / "d", [3, 2, 4])
    (tmp_path / "list.txt").write_text("# shards\nd/s-00.tar\nd/s-{01..02}.tar\n")
    assert shard_urls(str(tmp_path / "d")) == urls
    assert shard_urls(str(tmp_path / "d" / "s-{00..02}.tar")) == urls
    assert shard_urls(str(tmp_path / "list.txt")) == urls
    for nothing, said in (("d/s-{02..00}.tar", "names no shards; write a brace range low to high"), ("", "is empty")):
        with pytest.raises(DataError, match=said):  # an empty index was written, or the working folder read
            shard_urls(nothing)
    index = scan_index(urls)
    assert index.counts == [3, 2, 4] and index.classes == ["0", "1"]
    # Names made up from the labels stay that (never exported as names), through index.json too.
    assert class_names({"classes": index.classes}) is None and class_names({"classes": ["0", "1"]}) == ["0", "1"]
    write_index(tmp_path / "index.json", index)
    assert isinstance(read_index(tmp_path / "index.json", urls).classes, IndexNames)
    write_index(tmp_path / "index.json", ShardIndex(urls, index.counts, ["cat", "dog"]))
    assert class_names(read_index(tmp_path / "index.json", urls)) == ["cat", "dog"]
    for classes, named in ((["0", "1"], None), (["cat", "dog"], ["cat", "dog"])):  # an index.json from before "named"
        saved = json.loads((tmp_path / "index.json").read_text())
        saved.pop("named", None)
        (tmp_path / "index.json").write_text(json.dumps({**saved, "classes": classes}))
        assert class_names(read_index(tmp_path / "index.json", urls)) == named
    # A pipe: command streams the same samples as the file (seeking is replaced by reading past them).
    piped = [s.key for s in read_samples(f"pipe:cat {urls[2]}", skip=1, count=2)]
    assert piped == [s.key for s in read_samples(urls[2], skip=1, count=2)] == ["00006", "00007"]


def test_webdataset_shardwriter_shards_read_back_with_every_image_extension_and_label_kind(tmp_path):
    wds = pytest.importorskip("webdataset", reason="webdataset (the dev extra) writes the shards of this test")
    pattern = str(tmp_path / "w-%03d.tar")
    kinds = [("jpg", "JPEG"), ("jpeg", "JPEG"), ("png", "PNG"), ("webp", "WEBP")]
    with wds.ShardWriter(pattern, maxcount=5) as sink:
        for i in range(12):
            ext, fmt = kinds[i % 4]
            label = {"cls": i % 3} if i % 2 else {"json": {"label": i % 3, "note": "x"}}
            sink.write({"__key__": f"sample{i:03d}", ext: jpeg_bytes(40 * (i % 4), fmt), **label})
    urls = shard_urls(str(tmp_path / "w-{000..002}.tar"))
    samples = [s for url in urls for s in read_samples(url)]
    assert [s.key for s in samples] == [f"sample{i:03d}" for i in range(12)]
    assert [s.label for s in samples] == [i % 3 for i in range(12)]
    assert all(s.image and not s.problem for s in samples)
    # ... and train the tiny model (held-out share for validation).
    root = str(tmp_path / "w-{000..002}.tar")
    cfg = load_config(None, [*TREE, "model.num_classes=3", "data.source=shards", f"data.root={root}",
                             "data.val_fraction=0.2", "train.batch_size=4", f"log.out_dir={tmp_path}/r"])  # fmt: skip
    from vitrain.api import train

    summary = train(cfg)
    assert summary["steps"] == 2 and summary["val_samples"] == 2  # 20% of each 5/5/2-sample shard: 1, 1, 0


@pytest.mark.parametrize("cut", ["at-a-member", "in-a-label-header"])
@pytest.mark.parametrize("piped", [False, True], ids=["file", "pipe"])
def test_a_shard_cut_off_between_or_inside_headers_is_truncated_not_short(tmp_path, cut, piped):
    (url,) = write_shards(tmp_path, [6])
    label_member = [m for m in tarfile.open(url) if m.name.endswith(".cls")][3]  # tarfile reads either as the end
    raw = Path(url).read_bytes()
    Path(url).write_bytes(raw[: label_member.offset + (100 if cut == "in-a-label-header" else 0)])
    url = f"pipe:cat {url}" if piped else url
    for labels_only in (False, True):
        with pytest.raises(DataError, match=rf"^shard {re.escape(url)} is truncated .* sample 00003\)"):
            list(read_samples(url, labels_only=labels_only))


def test_a_json_label_that_is_not_an_integer_and_two_cls_that_differ_are_bad_samples(tmp_path):
    writer = ShardWriter(str(tmp_path / "s-00.tar"))
    for key, label in (("half", {"json": b"1.5"}), ("yes", {"json": b'{"label": true}'}), ("two", {"json": b"2.0"})):
        writer.write(key, {"jpg": jpeg_bytes(0), **label})
    writer.write("both", {"jpg": jpeg_bytes(0), "cls": b"1"})
    writer.write("both", {"cls": b"0"})  # a second member of the same sample
    writer.write("same", {"jpg": jpeg_bytes(0), "cls": b"1"})
    writer.write("same", {"cls": b"1\n"})
    writer.close()
    samples = {s.key: s for s in read_samples(str(tmp_path / "s-00.tar"))}
    assert [(k, s.label) for k, s in samples.items()] == [("half", None), ("yes", None), ("two", 2), ("both", None),
                                                           ("same", 1)]  # fmt: skip
    assert samples["half"].problem == samples["yes"].problem == "has a .json label that is not an integer"
    assert samples["both"].problem == "has two .cls labels that differ"


# ---------------------------------------------------------------------------------------------- the split


def test_two_ranks_of_two_workers_see_disjoint_samples_all_once_and_the_same_steps(tmp_path):
    urls = write_shards(tmp_path, [10, 6, 9, 7, 8, 11, 13])  # 7 uneven shards, 64 samples
    seen, steps = [], []
    for rank in range(2):
        loader = _stream(urls, [10, 6, 9, 7, 8, 11, 13], rank=rank, world_size=2, workers=2)
        batches = _keys(loader)
        steps.append(len(batches))
        seen.append([k for b in batches for k in b])
    assert steps == [8, 8]  # 32 per rank in batches of 4
    assert not set(seen[0]) & set(seen[1])
    assert len(set(seen[0] + seen[1])) == 64  # every sample once (64 = 2 ranks x 8 batches x 4)
    # Another epoch: another order (shards and windows), the same samples.
    again = [k for b in _keys(_stream(urls, [10, 6, 9, 7, 8, 11, 13], world_size=2, workers=2), epoch=1) for k in b]
    assert again != seen[0] and len(set(again)) == 32


def test_the_stream_hands_freed_batches_back_to_the_os_every_trim_every_batches(tmp_path, monkeypatch):
    from vitrain.data import stream

    stream.trim_heap()  # glibc's malloc_trim where there is one, else nothing: it must not fail either way
    calls = []
    monkeypatch.setattr(stream, "trim_heap", lambda: calls.append(1))
    urls = write_shards(tmp_path, [40, 40])
    batches = _keys(_stream(urls, [40, 40], batch_size=2))  # 40 batches
    assert len(batches) == 40 and len(calls) == 40 // stream.TRIM_EVERY


def test_a_share_that_does_not_divide_drops_under_a_batch_per_rank_and_never_repeats(tmp_path):
    counts = [5, 3, 9]
    urls = write_shards(tmp_path, counts)
    keys = [[k for b in _keys(_stream(urls, counts, rank=r, world_size=2, workers=2)) for k in b] for r in range(2)]
    assert len(keys[0]) == len(keys[1]) == 8  # 17 samples: 8 per rank, 1 left for another epoch
    assert len(set(keys[0] + keys[1])) == 16


def test_validation_pads_the_last_rank_with_masked_samples_so_every_sample_counts_once(tmp_path):
    urls = write_shards(tmp_path, [5, 4])
    labels = []
    for rank in range(2):
        loader = _stream(urls, [5, 4], rank=rank, world_size=2, workers=2, shuffle=False, drop_last=False)
        labels += [y for _, y in loader.epoch(0)]
    real = torch.cat(labels)
    assert len(real) == 10 and int((real == -100).sum()) == 1


def _children(pid: int) -> dict[int, str]:
    """The processes whose parent is `pid`, and their command lines (Linux's /proc)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == pid:
            found[int(stat.parent.name)] = cmdline
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from Linux's /proc")
def test_loader_workers_start_from_a_fork_server_not_forked_from_the_training_process(tmp_path):
    # A worker forked from the training process once hung before running a line (CPython 3.11.7, gh-112275: a
    # thread-state lock copied held): vitrain/data/loader.py worker_context, results/loader-fork-hang.
    urls = write_shards(tmp_path, [8, 8])
    batches = _stream(urls, [8, 8], workers=1).epoch(0)
    next(batches)  # the worker runs now
    mine = Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode()
    children = _children(os.getpid())
    assert mine not in children.values(), children  # no copy of this process
    servers = [pid for pid, cmdline in children.items() if "multiprocessing.forkserver" in cmdline]
    assert servers and any(_children(pid) for pid in servers), children  # the worker is the fork server's
    for _ in batches:
        pass


KILLED_MID_EPOCH = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
from tests.test_shards import _stream
batches = _stream(sys.argv[2:], [8, 8], workers=1).epoch(0)
next(batches)  # the worker runs
print("worker up", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_training_process_takes_its_loader_workers_with_it(tmp_path):
    # Workers from the fork server are the server's children, which torch's check of the parent does not cover: a
    # SIGKILLed run left them, holding its stdout and stderr, and a caller waiting for those waited forever.
    urls = write_shards(tmp_path, [8, 8])
    done = subprocess.run(
        [sys.executable, "-c", KILLED_MID_EPOCH, str(REPO), *urls], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == -9 and "worker up" in done.stdout, done.stderr[-2000:]


SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
from tests.test_shards import _stream

def main():
    for _ in _stream(sys.argv[2:], [8, 8], workers=1).epoch(0):
        pass
    print("read", flush=True)

{call}
"""


@pytest.mark.parametrize(
    "call, says",
    [
        ("main()", "script.py:11 starts training at the script's top level, and data.loader_workers=1 worker"),
        ('if __name__ == "__main__":\n    main()', "read"),
    ],
)
def test_a_script_that_starts_loader_workers_at_its_top_level_is_refused_naming_its_line(tmp_path, call, says):
    # Each worker from the fork server imports the script: unguarded, that import ran the training again and Python
    # stopped it with its bootstrapping error (about 100 lines with torch's), after the run folder was written.
    urls = write_shards(tmp_path, [8, 8])
    script = tmp_path / "script.py"
    script.write_text(SCRIPT.format(call=call))
    done = subprocess.run([sys.executable, str(script), str(REPO), *urls], capture_output=True, text=True, timeout=60)
    out = done.stdout + done.stderr
    assert says in out.strip().splitlines()[-1], out[-3000:]
    assert "bootstrapping" not in out


EXEC_WRAPPER = """
import sys
if __name__ == "__main__":
    sys.argv = sys.argv[1:]
    exec(open(sys.argv[0]).read())




print(
    "lines 11-14 of this wrapper run on import",
)
"""


def test_code_a_guarded_script_execs_is_not_read_against_the_scripts_own_lines(tmp_path):
    # The exec'd code's module frame shares the script's globals: its line 12 (main()) was looked up in the wrapper's
    # source, where line 12 is an unguarded statement.
    urls = write_shards(tmp_path, [8, 8])
    inner, wrapper = tmp_path / "inner.py", tmp_path / "wrapper.py"
    inner.write_text(SCRIPT.format(call='if __name__ == "__main__":\n    main()'))
    wrapper.write_text(EXEC_WRAPPER)
    done = subprocess.run(
        [sys.executable, str(wrapper), str(inner), str(REPO), *urls], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and "read" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize(
    "source, line, runs",
    [
        ("train()", 1, True),
        ('if __name__ == "__main__":\n    train()', 2, False),
        ('if "__main__" == __name__:\n    train()', 2, False),
        ('if __name__ in ("__main__",):\n    train()', 2, False),
        ('if __name__ == "__main__":\n    pass\nelse:\n    train()', 4, True),
        ('if __name__ != "__main__":\n    pass\nelse:\n    train()', 4, False),
        ('try:\n    if __name__ == "__main__":\n        train()\nfinally:\n    pass', 3, False),
        ("for _ in range(2):\n    train()", 2, True),
        ("if DEBUG:\n    train()", 2, True),
        ('if __name__ == "__main__" and READY:\n    train()', 2, False),
        ('if not __name__ == "__main__":\n    pass\nelse:\n    train()', 4, False),
        ('match __name__:\n    case "__main__":\n        train()', 3, False),
        ('if __name__ in ("__main__", "__mp_main__"):\n    train()', 2, True),  # a worker imports it as __mp_main__
        ('if __name__ == "__main__" or DEBUG:\n    train()', 2, True),
        ("train(", 1, False),  # does not parse: no claim
    ],
)
def test_which_lines_of_a_script_run_when_a_worker_imports_it(source, line, runs):
    assert runs_on_import(source, line) is runs


# ---------------------------------------------------------------------------------------------- resume


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_resumed_mid_epoch_continues_with_the_uninterrupted_samples(tmp_path, workers):
    counts = [10, 6, 9, 7, 8, 11, 13]
    urls = write_shards(tmp_path, counts)
    full = _keys(_stream(urls, counts, workers=workers), epoch=2)
    for k in (1, 5, 11):
        loader = _stream(urls, counts, workers=workers)
        at = Position.from_dict(json.loads(json.dumps(loader.position(2, None, k).to_dict())))
        assert loader.batches_left(at) == len(full) - k
        assert _keys(loader, 2, at) == full[k:]


def test_a_stream_resumed_on_another_world_size_sees_none_of_the_epoch_again(tmp_path):
    counts = [10, 6, 9, 7, 8, 11, 13]
    urls = write_shards(tmp_path, counts)
    before = []
    for rank in range(2):
        loader = _stream(urls, counts, rank=rank, world_size=2, workers=2)
        before += [k for b in _keys(loader)[:3] for k in b]
    at = loader.position(0, None, 3)
    after = [k for b in _keys(_stream(urls, counts, workers=1, batch_size=5), 0, at) for k in b]
    assert not set(before) & set(after) and len(after) == 40  # 64 - 24 seen = 40 left, 8 batches of 5
    # ... and a second change of layout keeps counting from both earlier ones.
    one = _stream(urls, counts, workers=1, batch_size=5)
    later = one.position(0, at, 2)
    rest = [k for b in _keys(_stream(urls, counts, rank=1, world_size=2, workers=1), 0, later) for k in b]
    first_two = [k for b in _keys(one, 0, at)[:2] for k in b]
    assert not set(rest) & (set(before) | set(first_two))


def _pack(tmp_path: Path, fmt: str) -> Path:
    make_tree(tmp_path / "tree", {"train": 20, "test": 4}, suffix=".jpg")
    out = tmp_path / fmt
    done = run_cli("data", "pack", str(tmp_path / "tree"), str(out), "--format", fmt, "--shard-samples", "7")
    assert done.returncode == 0, done.stderr
    return out


@pytest.mark.parametrize("source", ["shards", "recordio", "folder", "prepared"])
def test_every_source_resumes_mid_epoch_with_the_same_keys_and_reshards_without_repeats(tmp_path, source):
    if source == "prepared":
        make_tree(tmp_path / "tree", {"train": 20, "test": 4}, suffix=".jpg")
        assert run_cli("data", "prepare", str(tmp_path / "tree"), str(tmp_path / "prepared")).returncode == 0
        root = tmp_path / "prepared"
    elif source == "folder":
        make_tree(tmp_path / "tree", {"train": 20, "test": 4}, suffix=".jpg")
        root = tmp_path / "tree"
    else:
        root = _pack(tmp_path, source)

    def loader(rank=0, world_size=1, batch=4):
        cfg = load_config(None, [*TREE, f"data.source={source}", f"data.root={root}", f"train.batch_size={batch}",
                                 "data.shuffle_buffer=6", "data.prefetch=0"])  # fmt: skip
        return build_loaders(cfg, torch.device("cpu"), rank, world_size)[0]

    full = _keys(loader(), epoch=1)
    assert len(full) == 10
    at = loader().position(1, None, 4)
    assert _keys(loader(), 1, at) == full[4:]
    seen = {k for b in full[:4] for k in b}
    rest = [k for r in range(2) for b in _keys(loader(r, 2, 2), 1, at) for k in b]
    assert not seen & set(rest) and len(rest) == 24 and len(set(rest)) == 24


# ---------------------------------------------------------------------------------------------- pack and train


# slow: 27 s on a Zen 4; a rerun pack and a packed video tree that trains run in the default suite
@pytest.mark.slow
def test_pack_writes_shards_and_recordio_that_train_and_hold_the_source_bytes(tmp_path):
    shards = _pack(tmp_path, "shards")
    names = sorted(p.name for p in shards.glob("*.tar"))  # 40 train and 8 test images in shards of 7
    assert names == ["test-000000.tar", "test-000001.tar", *[f"train-{k:06d}.tar" for k in range(6)]]
    records = _pack(tmp_path, "recordio")
    from vitrain.data.recordio import read_insightface

    rec = read_insightface(records / "train.rec")
    tree = tmp_path / "tree"
    assert len(rec) == 40 and all(rec.image(i) == (tree / rec.names[i]).read_bytes() for i in range(40))
    for source, root in (("shards", shards), ("recordio", records)):
        done = run_cli("train", *TREE, f"data.source={source}", f"data.root={root}", "train.batch_size=8",
                       f"log.out_dir={tmp_path}/runs", f"name={source}")  # fmt: skip
        assert done.returncode == 0, done.stderr
        summary = json.loads((tmp_path / "runs" / source / "summary.json").read_text())
        assert summary["steps"] == 5 and summary["val_samples"] == 8


def test_a_rerun_pack_keeps_finished_shards_and_writes_only_missing_ones(tmp_path):
    out = _pack(tmp_path, "shards")
    (out / "train-000003.tar").unlink()
    kept = (out / "train-000001.tar").stat().st_mtime_ns
    done = run_cli("data", "pack", str(tmp_path / "tree"), str(out), "--format", "shards", "--shard-samples", "7")
    assert done.returncode == 0 and (out / "train-000003.tar").is_file()
    assert (out / "train-000001.tar").stat().st_mtime_ns == kept


# slow: 11 s on a Zen 4
@pytest.mark.slow
def test_recordio_packs_of_real_faces_hold_the_folder_bytes_and_train_face_orl(tmp_path):
    orl = shared_data("orl-faces.zip")
    out = tmp_path / "orl"
    assert run_cli("data", "pack", str(orl), str(out), "--format", "recordio", "--identities").returncode == 0
    from vitrain.data.recordio import read_insightface

    rec = read_insightface(out)
    with zipfile.ZipFile(orl) as archive:
        assert len(rec) == 400 and all(rec.image(i) == archive.read(rec.names[i]) for i in range(len(rec)))
    done = run_cli("train", "face-orl", "data.source=recordio", f"data.root={out}", "train.max_steps=3",
                   "precision.mode=fp32", f"log.out_dir={tmp_path}/runs", "log.progress=false")  # fmt: skip
    assert done.returncode == 0, done.stderr


# ---------------------------------------------------------------------------------------------- no hang


def test_seven_uneven_shards_on_two_ranks_train_to_the_end_without_a_hang(tmp_path):
    write_shards(tmp_path / "seven", [10, 6, 9, 7, 8, 11, 13])
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "vitrain",
         "train", *TREE, "data.source=shards", f"data.root={tmp_path / 'seven'}", "train.batch_size=4",
         "train.epochs=2", "train.threads=1", "parallel.strategy=ddp", f"log.out_dir={tmp_path}/runs", "name=seven"],
        cwd=REPO, capture_output=True, text=True, timeout=240,
        env={**os.environ, "MASTER_PORT": str(free_port()), **gpu_free_env(2)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((tmp_path / "runs" / "seven" / "summary.json").read_text())
    assert summary["steps"] == 12  # 64 samples, 13 held out (20%): 51 -> 25 per rank -> 6 steps of 4, 2 epochs


# ---------------------------------------------------------------------------------------------- bad input


def _last_line(done: subprocess.CompletedProcess) -> str:
    return done.stderr.strip().splitlines()[-1]


def _train(tmp_path: Path, source: str, root: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_cli("train", *TREE, f"data.source={source}", f"data.root={root}", "train.batch_size=4",
                   f"log.out_dir={tmp_path}/runs", *extra)  # fmt: skip


def test_a_truncated_shard_is_one_line_naming_it_and_exit_2(tmp_path):
    urls = write_shards(tmp_path / "t", [12, 12])
    (tmp_path / "t" / "index.json").write_text(json.dumps({"format": "vitrain-shards/1", "classes": ["0", "1"],
                                                          "counts": {"s-00.tar": 12, "s-01.tar": 12}}))  # fmt: skip
    raw = Path(urls[1]).read_bytes()
    Path(urls[1]).write_bytes(raw[: len(raw) // 2 + 100])
    done = _train(tmp_path, "shards", tmp_path / "t")
    assert done.returncode == 2 and "s-01.tar" in _last_line(done) and "truncated" in _last_line(done)


# slow: 14 s on a Zen 4; other bad shards are refused in one line in the default suite
@pytest.mark.slow
def test_a_sample_without_a_label_is_one_line_or_skipped_and_counted_with_skip_bad(tmp_path):
    folder = tmp_path / "nolabel"
    folder.mkdir()
    writer = ShardWriter(str(folder / "s-00.tar"), max_count=100)
    for n in range(20):
        members = {"jpg": jpeg_bytes(n)} | ({} if n == 7 else {"cls": str(n % 2).encode()})
        writer.write(f"{n:05d}", members)
    writer.close()
    (folder / "index.json").write_text(json.dumps({"format": "vitrain-shards/1", "classes": ["0", "1"],
                                                  "counts": {"s-00.tar": 20}}))  # fmt: skip
    done = _train(tmp_path, "shards", folder, "data.val_fraction=0.1")
    assert done.returncode == 2 and "00007" in _last_line(done) and "no label" in _last_line(done)
    assert "data.skip_bad" in _last_line(done)
    done = _train(tmp_path, "shards", folder, "data.val_fraction=0.1", "data.skip_bad=1", "name=skipping")
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "runs" / "skipping" / "summary.json").read_text())
    assert summary["skipped_samples"] == 1
    assert "skipped sample 00007" in (tmp_path / "runs" / "skipping" / "log.txt").read_text()


@pytest.mark.parametrize("skip_bad", [0, 2])
def test_a_label_past_the_classes_is_a_bad_sample_named_or_skipped(tmp_path, skip_bad):
    urls = write_shards(tmp_path / "s", [6], classes=3)  # labels 0 1 2 0 1 2; the index names 2 classes
    loader = _stream(urls, [6], workers=0, shuffle=False, window=1, batch_size=3)
    loader.data.skip_bad = skip_bad
    if not skip_bad:
        with pytest.raises(DataError, match=r"sample 0000[25] .* has label 2, outside the data's 2 classes") as error:
            list(loader.epoch(0))
        assert "data.skip_bad=0" in str(error.value) and "\n" not in str(error.value)
        return
    labels = torch.cat([batch[1] for batch in loader.epoch(0)])
    assert len(labels) == 6 and labels.max() < 2
    assert sorted(where.split()[0] for where in loader.skipped) == ["00002", "00005"]


def test_a_bad_sample_counts_as_skipped_when_its_batch_is_taken_not_when_prefetched(tmp_path, monkeypatch):
    monkeypatch.setattr("vitrain.data.stream.in_background", lambda items, depth: iter(list(items)))  # all ahead
    urls = write_shards(tmp_path / "s", [6], classes=3)  # labels 0 1 2 0 1 2; the index names 2 classes
    loader = _stream(urls, [6], workers=0, shuffle=False, window=1, batch_size=2, prefetch=2)
    loader.data.skip_bad = 2
    batches = loader.epoch(0)
    next(batches)
    assert loader.skipped == {}
    list(batches)
    assert sorted(where.split()[0] for where in loader.skipped) == ["00002", "00005"]


@pytest.mark.parametrize(
    "saved, says",
    [
        ([1], "holds a JSON list, not an object"),
        ({"format": "vitrain-shards/1", "counts": [3], "classes": ["a"]}, "counts is not an object"),
        ({"format": "vitrain-shards/1", "counts": {"s-00.tar": 3}}, "classes is not a list of class names"),
    ],
    ids=["list", "counts-list", "no-classes"],
)
def test_an_index_of_the_wrong_structure_is_one_line_naming_it(tmp_path, saved, says):
    urls = write_shards(tmp_path, [3])
    (tmp_path / "index.json").write_text(json.dumps(saved))
    with pytest.raises(DataError, match=f"^shard index {re.escape(str(tmp_path / 'index.json'))}:? {says}"):
        load_index(urls, "data.root")


# slow: 10 s on a Zen 4; a truncated shard is refused in one line in the default suite
@pytest.mark.slow
def test_a_recordio_file_with_a_wrong_magic_or_an_index_past_its_end_is_one_line_and_exit_2(tmp_path):
    out = _pack(tmp_path, "recordio")
    rec, idx = out / "train.rec", out / "train.idx"
    good_idx = idx.read_text()
    lines = good_idx.splitlines()
    lines[3] = lines[3].split("\t")[0] + "\t99999999"
    idx.write_text("\n".join(lines) + "\n")
    done = _train(tmp_path, "recordio", out)
    assert done.returncode == 2 and "99999999" in _last_line(done) and "train.idx" in _last_line(done)
    idx.write_text(good_idx)
    offset = int(lines[5].split("\t")[1])
    raw = bytearray(rec.read_bytes())
    raw[offset : offset + 4] = b"\0\0\0\0"
    rec.write_bytes(bytes(raw))
    done = _train(tmp_path, "recordio", out)
    assert done.returncode == 2 and f"byte {offset}" in _last_line(done) and "train.rec" in _last_line(done)


def _pack_here(capsys, src: Path, out: Path, fmt: str) -> tuple[int, str]:
    """`vitrain data pack SRC OUT --format FMT` in process: its exit code and stderr."""
    from vitrain.cli import main

    code = main(["data", "pack", str(src), str(out), "--format", fmt, "--shard-samples", "7"])
    return code, capsys.readouterr().err


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("fmt", ["shards", "recordio"])
def test_a_pack_into_a_folder_packed_from_another_source_is_one_line_and_changes_nothing(tmp_path, capsys, fmt):
    make_tree(tmp_path / "tree", {"train": 20, "test": 4}, suffix=".jpg")
    make_tree(tmp_path / "other", {"train": 13, "test": 3}, suffix=".jpg")
    out = tmp_path / fmt
    assert _pack_here(capsys, tmp_path / "tree", out, fmt)[0] == 0
    before = _files(out)
    assert _pack_here(capsys, tmp_path / "tree", out, fmt)[0] == 0  # the same source again: as before
    assert _files(out).keys() == before.keys()
    code, err = _pack_here(capsys, tmp_path / "other", out, fmt)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"vitrain: error: {out} already holds a pack of ") and "new folder" in lines[0]
    (tmp_path / "tree" / "train" / "cat" / "000.jpg").rename(tmp_path / "tree" / "train" / "cat" / "renamed.jpg")
    code, err = _pack_here(capsys, tmp_path / "tree", out, fmt)  # the same folder, one image renamed
    assert code == 2 and "with different list of source files (images added, removed or renamed)" in err, err
    assert _files(out) == before


def _renamed_class(tree: Path) -> str:
    (tree / "test" / "dog").rename(tree / "test" / "dgo")
    return "classes ['dgo'] that the train split does not have"


def _empty_class(tree: Path) -> str:
    (tree / "test" / "bird").mkdir()
    return f"class folder {tree / 'test' / 'bird'} is empty"


def _two_depths(tree: Path) -> str:
    (tree / "train" / "dog" / "puppies").mkdir()
    (tree / "train" / "dog" / "000.png").rename(tree / "train" / "dog" / "puppies" / "000.png")
    return "images at two depths"


def _unlabelled_folder(tree: Path) -> str:
    (tree / "val").mkdir()
    (tree / "train" / "cat" / "000.png").rename(tree / "val" / "000.png")  # ImageNet's raw val/: no class folders
    return f"images at two depths, {tree / 'val' / '000.png'} and {tree / 'test' / 'cat' / '000.png'}"


# Each mistake once cost a whole split without a word (pack tried every folder as a split, skipping any it could not
# read) or read the tree another way than `vitrain data prepare`; both now list a tree alike and refuse these.
@pytest.mark.parametrize("mistake", [_renamed_class, _empty_class, _two_depths, _unlabelled_folder])
def test_pack_and_prepare_refuse_a_tree_that_would_lose_a_split_or_a_class(tmp_path, capsys, mistake):
    from vitrain.cli import main

    make_tree(tmp_path / "tree", {"train": 3, "test": 2})
    said = mistake(tmp_path / "tree")
    for command in (["pack", "--format", "shards"], ["prepare"]):
        out = tmp_path / command[0]
        code = main(["data", command[0], str(tmp_path / "tree"), str(out), *command[1:]])
        err = capsys.readouterr().err
        assert code == 2 and said in err and len(err.strip().splitlines()) == 1, (command, err)
        assert not out.exists() or not any(out.iterdir())


def test_the_folder_source_names_a_class_folder_whose_images_sit_one_folder_down(tmp_path):
    from vitrain.data.sources import ImageTree, list_split

    make_tree(tmp_path / "tree", {"train": 3})
    (tmp_path / "tree" / "train" / "dog").rename(tmp_path / "puppies")
    (tmp_path / "tree" / "train" / "dog").mkdir()
    (tmp_path / "puppies").rename(tmp_path / "tree" / "train" / "dog" / "puppies")
    with pytest.raises(DataError, match="holds images only in folders below it .*puppies/000.png"):
        list_split(ImageTree(tmp_path / "tree"), "train", required=True)


def test_pack_reads_a_zip_with_one_top_folder_and_a_bare_class_tree_as_prepare_does(tmp_path, capsys):
    from tests.data_helpers import zip_tree

    make_tree(tmp_path / "tree", {"train": 3, "test": 2})
    zip_tree(tmp_path / "tree", tmp_path / "tree.zip")
    assert _pack_here(capsys, tmp_path / "tree.zip", tmp_path / "zipped", "shards")[0] == 0
    assert sorted(p.name for p in (tmp_path / "zipped").glob("*.tar")) == ["test-000000.tar", "train-000000.tar"]
    make_tree(tmp_path / "bare", {"": 3})  # <class>/<image> only: the train split
    assert _pack_here(capsys, tmp_path / "bare", tmp_path / "packed", "shards")[0] == 0
    assert sorted(p.name for p in (tmp_path / "packed").glob("*.tar")) == ["train-000000.tar"]


@pytest.mark.parametrize("held", ["index.json", "train.rec"])
def test_a_pack_into_a_folder_holding_files_of_no_pack_is_one_line(tmp_path, capsys, held):
    make_tree(tmp_path / "tree", {"train": 20, "test": 4}, suffix=".jpg")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / held).write_text("something else")
    code, err = _pack_here(
        capsys, tmp_path / "tree", tmp_path / "out", "shards" if held == "index.json" else "recordio"
    )
    assert code == 2 and "is not empty and holds no pack.json" in err, err
    assert _files(tmp_path / "out") == {held: b"something else"}


@pytest.mark.parametrize("out_is", ["a_file", "a_folder_of_other_files", "another_sources_pack"])
def test_a_pack_folder_that_is_refused_is_refused_before_the_source_is_listed(tmp_path, capsys, monkeypatch, out_is):
    # Listing a large tree or zip takes minutes; the refusal of OUT needs none of it.
    out = tmp_path / "out"
    if out_is == "a_file":
        out.write_text("kept")
    elif out_is == "a_folder_of_other_files":
        out.mkdir()
        (out / "notes.txt").write_text("kept")
    else:
        make_tree(tmp_path / "other", {"train": 5, "test": 2}, suffix=".jpg")
        assert _pack_here(capsys, tmp_path / "other", out, "shards")[0] == 0
    make_tree(tmp_path / "tree", {"train": 5, "test": 2}, suffix=".jpg")

    def listed(*args, **kwargs):
        raise AssertionError("the source was listed before OUT was checked")

    monkeypatch.setattr("vitrain.data.pack.list_source", listed)
    code, err = _pack_here(capsys, tmp_path / "tree", out, "shards")
    assert code == 2 and len(err.strip().splitlines()) == 1 and str(out) in err, err


@pytest.mark.parametrize("command", ["pack_into_a_file", "pack_under_a_file", "index_out_a_folder"])
def test_an_output_path_of_pack_or_index_that_cannot_be_written_is_one_line(tmp_path, capsys, command):
    from vitrain.cli import main

    (tmp_path / "file").write_text("kept")
    if command == "index_out_a_folder":
        urls = write_shards(tmp_path / "s", [3])
        argv, named = ["data", "index", urls[0], "--out", str(tmp_path)], f"--out {tmp_path}: "
    else:
        make_tree(tmp_path / "tree", {"train": 4, "test": 2}, suffix=".jpg")
        out = tmp_path / "file" / ("x" if command == "pack_under_a_file" else "")
        argv, named = ["data", "pack", str(tmp_path / "tree"), str(out), "--format", "shards"], "data pack: "
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"vitrain: error: {named}"), err
    assert (tmp_path / "file").read_text() == "kept"


def test_too_few_samples_for_every_rank_to_take_a_batch_is_one_line(tmp_path):
    write_shards(tmp_path / "few", [3])
    done = _train(tmp_path, "shards", tmp_path / "few", "data.val_fraction=0.34")
    assert done.returncode == 2 and "train.batch_size=4" in _last_line(done)


def test_a_shard_list_naming_a_missing_shard_is_one_line(tmp_path):
    write_shards(tmp_path / "m", [3, 3])
    done = _train(tmp_path, "shards", Path(f"{tmp_path}/m/s-{{00..02}}.tar"))
    assert done.returncode == 2 and "s-02.tar does not exist" in _last_line(done)


def test_a_list_file_naming_a_missing_shard_is_one_line_naming_it(tmp_path):
    write_shards(tmp_path, [3])
    listed = tmp_path / "train.txt"
    listed.write_text("s-00.tar\nmissing.tar\npipe:cat s-00.tar\n")  # relative to the list; commands not checked
    with pytest.raises(
        DataError, match=r"data\.root=.*train\.txt: shard .*missing\.tar does not exist; check the list"
    ):
        shard_urls(str(listed))


# ---------------------------------------------------------------------------------------------- kill and resume


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from vitrain import checkpoint as ckpt
    from vitrain.config import config_from_dict
    from vitrain.models import create_model

    step = ckpt.latest(run_dir)
    model = create_model(config_from_dict(ckpt.read_meta(step)["config"]).model)
    ckpt.load_model_weights(step, model)
    return model.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("source", ["shards", "recordio", "folder", "prepared"])
def test_sigkill_mid_epoch_then_resume_sees_the_uninterrupted_samples_and_ends_bit_for_bit(tmp_path, source):
    import random

    if source in ("shards", "recordio"):
        root = _pack(tmp_path, source)
    else:
        make_tree(tmp_path / "tree", {"train": 20, "test": 4}, suffix=".jpg")
        root = tmp_path / "tree"
        if source == "prepared":
            assert run_cli("data", "prepare", str(root), str(tmp_path / "prepared")).returncode == 0
            root = tmp_path / "prepared"
    common = [*TREE, f"data.source={source}", f"data.root={root}", "train.batch_size=4", "train.epochs=3",
              "train.checkpoint_every_steps=3", "data.shuffle_buffer=6", "data.crop_padding=1", "data.hflip=0.5",
              f"log.out_dir={tmp_path}/runs"]  # fmt: skip

    def run(fault: str, name: str, trace: str, *extra: str) -> subprocess.CompletedProcess:
        env = {**os.environ, TRACE_ENV: str(tmp_path / trace)}
        return subprocess.run([sys.executable, str(REPO / "tests" / "fault_runner.py"), fault, "train", *common,
                               f"name={name}", *extra], cwd=REPO, capture_output=True, text=True, env=env,
                              timeout=300)  # fmt: skip

    assert run("none", "reference", "reference.txt").returncode == 0
    kill_at = random.Random(source).randint(4, 25)  # 10 steps an epoch: mid-epoch, after a checkpoint or two
    assert run(f"kill_after:{kill_at}:0", "victim", "killed.txt").returncode == -9
    resumed = run("none", "victim", "resumed.txt", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    at = int(re.search(r"resumed from \S+ at step (\d+)", resumed.stderr).group(1))
    assert 0 < at <= kill_at

    def train_lines(name: str) -> list[str]:
        return [line for line in (tmp_path / name).read_text().splitlines() if line.startswith("train ")]

    assert train_lines("resumed.txt") == train_lines("reference.txt")[at:]
    want, got = _final_weights(tmp_path / "runs" / "reference"), _final_weights(tmp_path / "runs" / "victim")
    assert all(torch.equal(got[k], v) for k, v in want.items())
