"""Loading a checkpoint never runs code: crafted meta and DCP files are refused in one line, their payload unrun."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pickle
import random
import shutil
import tarfile
import uuid
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from tests.conftest import reseal_with_checksums, run_cli, tiny_overrides
from tests.distributed_helpers import free_port, tiny_config, torchrun_env
from vitrain import checkpoint as ckpt
from vitrain.cli import main
from vitrain.config import config_from_dict
from vitrain.engine import Trainer
from vitrain.engine.protocol import load_model_weights
from vitrain.errors import CheckpointError, ConfigError, DataError
from vitrain.models import create_model
from vitrain.weights import load_pretrained, read_weights


class Payload:
    """Unpickling this runs a shell command that creates a file: proof that loading ran code."""

    def __init__(self, proof):
        self.proof = str(proof)

    def __reduce__(self):
        return (os.system, (f"touch {self.proof}",))


def reseal(step_dir):
    """Rewrite COMPLETE for the folder's current files, as an attacker who hands out a whole folder would."""
    files = {p.name: p.stat().st_size for p in step_dir.iterdir() if p.name != ckpt.COMPLETE_FILE}
    (step_dir / ckpt.COMPLETE_FILE).write_text(json.dumps({"step": 1, "files": files}))


@pytest.fixture
def step_dir(tmp_path):
    cfg = tiny_config(tmp_path / "runs", "victim", train={"max_steps": 1})
    Trainer(cfg).fit()
    return ckpt.latest(cfg.run_dir)


def test_pickled_payload_really_runs_when_unpickled(tmp_path):
    # The fixture's payload is live: plain pickle runs it (so the tests below prove something).
    proof = tmp_path / "ran"
    pickle.loads(pickle.dumps(Payload(proof)))
    assert proof.exists()


def _as_legacy_with(step_dir, meta_obj):
    """Turn a step folder into the earlier format (pickled meta.pt, no JSON meta, no marker) holding meta_obj."""
    (step_dir / ckpt.META_FILE).unlink()
    (step_dir / ckpt.COMPLETE_FILE).unlink()
    torch.save(meta_obj, step_dir / ckpt.LEGACY_META_FILE)  # how format 2 wrote it


def refused_line(command: str, step_dir, tmp_path, *overrides: str) -> str:
    """Run a command that loads `step_dir` as a user would; it must exit 2 with one line on stderr: that line."""
    args = {
        "eval": ["eval", str(step_dir)],
        "export": ["export", str(step_dir), str(tmp_path / "out")],
        "resume": ["train", "log.progress=false", *overrides, "--resume", str(step_dir)],
    }[command]
    result = run_cli(*args, warnings="")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("command", ["eval", "export", "resume"])
def test_a_crafted_meta_file_is_refused_and_its_command_never_runs(tmp_path, step_dir, command):
    proof = tmp_path / "ran"
    _as_legacy_with(step_dir, {"config": {}, "step": Payload(proof)})
    line = refused_line(command, step_dir, tmp_path)
    assert f"checkpoint file {step_dir / ckpt.LEGACY_META_FILE}" in line and "refusing to load it" in line
    assert not proof.exists()


@pytest.mark.parametrize("command", ["eval", "export", "resume"])
def test_a_crafted_dcp_metadata_file_is_refused_and_its_command_never_runs(tmp_path, step_dir, command):
    proof = tmp_path / "ran"
    with open(step_dir / ckpt.DCP_INDEX, "wb") as handle:
        pickle.dump(Payload(proof), handle)
    reseal(step_dir)
    assert f"checkpoint file {step_dir / ckpt.DCP_INDEX} refers to posix.system" in refused_line(
        command, step_dir, tmp_path
    )
    assert not proof.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_crafted_value_inside_the_dcp_shards_is_refused_and_never_runs(tmp_path):
    # DCP stores non-tensor values (hyperparameters, step counts) as pickles in the .distcp files.
    proof = tmp_path / "ran"
    folder = tmp_path / "crafted"
    dcp.save({"model": {"w": torch.ones(2)}, "trap": Payload(proof)}, checkpoint_id=folder, no_dist=True)
    assert not proof.exists()  # saving pickled the object without running it
    wanted = {"model": {"w": torch.zeros(2)}, "trap": None}
    with pytest.raises(CheckpointError, match="an object that is not plain data"):
        ckpt.load_extra(folder, wanted)
    assert not proof.exists()


def test_a_checkpoint_of_the_earlier_format_is_read_without_unpickling_code(tmp_path, step_dir):
    meta = json.loads((step_dir / ckpt.META_FILE).read_text())
    _as_legacy_with(step_dir, {**meta, "format": 2, "rng": {"torch": torch.get_rng_state()}})
    assert ckpt.is_complete(step_dir)
    loaded = ckpt.read_meta(step_dir)
    assert loaded["step"] == meta["step"] and loaded["config"] == meta["config"]
    result = run_cli("eval", str(step_dir))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["step"] == meta["step"]


@pytest.mark.parametrize("key, value", [("step", "abc"), ("epoch", -1), ("step", 2.5)])
def test_a_meta_step_or_epoch_that_is_no_whole_number_is_one_line_naming_the_checkpoint(step_dir, capsys, key, value):
    meta = json.loads((step_dir / ckpt.META_FILE).read_text())
    (step_dir / ckpt.META_FILE).write_text(json.dumps({**meta, key: value}))
    reseal(step_dir)
    assert main(["train", "--resume", str(step_dir), "train.max_steps=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"vitrain: error: checkpoint {step_dir / ckpt.META_FILE}: {key}="), err


def test_metadata_is_json_and_holds_no_pickle(step_dir):
    assert not (step_dir / ckpt.LEGACY_META_FILE).exists()
    meta = json.loads((step_dir / ckpt.META_FILE).read_text())
    assert meta["format"] == ckpt.FORMAT_VERSION and meta["step"] == 1


def test_a_tampered_shard_makes_the_checkpoint_damaged(tmp_path, step_dir):
    shard = next(step_dir.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=rf"is damaged \({shard.name} has \d+ bytes where its COMPLETE marker"):
        ckpt.read_meta(step_dir)


# ---------------------------------------------------------------------------------------------- the audit's minor two


@pytest.mark.parametrize("fill", ["random", "0x80"])
def test_a_shard_of_random_bytes_is_named_without_torchs_advice_to_load_it_unsafely(tmp_path, step_dir, fill):
    # Every item's bytes begin 0x80 0x80 under "0x80": torch reads a pickle of protocol 128 and warns of it beside
    # its error, as random bytes do now and then; the user sees vitrain's one line only.
    shard = next(step_dir.glob("*.distcp"))
    size = shard.stat().st_size
    shard.write_bytes(random.Random(33).randbytes(size) if fill == "random" else b"\x80" * size)
    reseal(step_dir)
    line = refused_line("eval", step_dir, tmp_path)
    assert f"checkpoint file {shard} is not a checkpoint vitrain can load safely" in line
    assert "weights_only" not in line and len(line) < 300


def test_an_old_protocol_pickle_as_init_from_gives_its_error_and_no_torch_warning(tmp_path):
    proof, weights = tmp_path / "ran", tmp_path / "evil.pt"
    with open(weights, "wb") as handle:
        pickle.dump(Payload(proof), handle, protocol=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(CheckpointError, match="model.init_from=.*evil.pt cannot be read"):
            read_weights(weights)
    assert not caught and not proof.exists()


def test_a_weights_file_keying_a_tensor_by_no_name_is_one_line_naming_it(tmp_path, tiny_model):
    path = tmp_path / "intkey.pt"
    torch.save({1: torch.zeros(2), **tiny_model.state_dict()}, path)
    with pytest.raises(CheckpointError, match=r"model.init_from=.*intkey.pt names a tensor by 1 \(int\), not a string"):
        read_weights(path)


def test_a_weights_file_holding_nan_is_named_not_the_runs_lr(tmp_path, tiny_model):
    state = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    state["cls_token"][0, 0, 0] = float("nan")
    save_file(state, str(tmp_path / "diverged.safetensors"))
    with pytest.raises(CheckpointError, match=r"diverged.safetensors: tensor cls_token holds inf/NaN .*another file$"):
        load_pretrained(tiny_model, tmp_path / "diverged.safetensors")


def test_half_a_head_of_another_size_is_named_as_the_missing_tensor(tmp_path, tiny_model):
    state = {**tiny_model.state_dict(), "head.bias": torch.zeros(5)}
    del state["head.weight"]
    save_file(state, str(tmp_path / "half.safetensors"))
    with pytest.raises(CheckpointError, match="half.safetensors holds .*: it lacks tensor head.weight$"):
        load_pretrained(tiny_model, tmp_path / "half.safetensors")


# ---------------------------------------------------------------------------------------------- an index that lies
# DCP's `.metadata` says where each tensor's bytes are and how large it is; an attacker who hands out a whole folder
# rewrites it and COMPLETE's checksums with it (`checkpoint verify` then finds every file intact).


def rewrite_index(step_dir, change, leave_out=()):
    """Apply `change` to the step folder's DCP index (its Metadata) and reseal the folder."""
    with open(step_dir / ckpt.DCP_INDEX, "rb") as handle:
        metadata = ckpt._MetadataUnpickler(handle).load()
    change(metadata)
    with open(step_dir / ckpt.DCP_INDEX, "wb") as handle:
        pickle.dump(metadata, handle)
    reseal_with_checksums(step_dir, leave_out)


def resize(key, size, covered=None):
    """An index change: tensor `key` declared of `size`, its one chunk of `covered` (default: all of it)."""

    def change(metadata):
        md = metadata.state_dict_metadata[key]
        chunk = dataclasses.replace(md.chunks[0], sizes=torch.Size(covered or size))
        metadata.state_dict_metadata[key] = dataclasses.replace(md, size=torch.Size(size), chunks=[chunk])

    return change


@pytest.mark.parametrize("form", ["another step's file", "an absolute path", "a symbolic link", "an unlisted file"])
def test_a_data_file_outside_the_step_folder_is_refused_naming_it_and_verify_says_so(tmp_path, step_dir, capsys, form):
    shard = next(step_dir.glob("*.distcp"))
    other = step_dir.with_name("step_00000000")  # an earlier step: other weights, which would load as this step's
    shutil.copytree(step_dir, other)
    name = {
        "another step's file": f"../{other.name}/{shard.name}",
        "an absolute path": str(other / shard.name),
        "a symbolic link": shard.name,
        "an unlisted file": "__9_0.distcp",
    }[form]
    if form == "a symbolic link":
        shard.unlink()
        shard.symlink_to(f"../{other.name}/{shard.name}")
        reseal_with_checksums(step_dir)
    else:
        if form == "an unlisted file":
            shutil.copy(other / shard.name, step_dir / name)

        def point(metadata):
            for key, info in metadata.storage_data.items():
                metadata.storage_data[key] = dataclasses.replace(info, relative_path=name)

        rewrite_index(step_dir, point, leave_out=[name])
    code, line = cli_line(capsys, "export", str(step_dir), str(tmp_path / "out"))
    assert code == 2 and line.startswith(f"vitrain: error: checkpoint {step_dir}: its ") and f"'{name}'" in line
    assert "refusing to load it" in line and not (tmp_path / "out").exists()
    assert main(["checkpoint", "verify", str(step_dir)]) == 2
    assert f"{step_dir}: refused: its " in capsys.readouterr().out


def test_an_index_whose_chunks_cover_part_of_a_tensor_is_refused_naming_it(tmp_path, step_dir, capsys):
    rewrite_index(step_dir, resize("model.head.weight", (4, 32), covered=(2, 32)))  # half of it would stay random
    code, line = cli_line(capsys, "eval", str(step_dir))
    assert code == 2 and line.startswith(f"vitrain: error: checkpoint {step_dir}: its index .metadata declares ")
    assert "model.head.weight of size (4, 32), but its chunks hold 64 of its 128 values" in line


def snapshot(folder):
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "key, strategy",
    [("rng.rank0.cpu", "single"), ("optim.state.cls_token.exp_avg", "zero1")],
)
def test_an_index_declaring_a_huge_state_is_refused_before_anything_is_allocated(
    tmp_path, step_dir, capsys, key, strategy
):
    size = (10**12,) if key.startswith("rng") else (10**6, 10**6)  # terabytes: allocating them fails at once
    rewrite_index(step_dir, resize(key, size))
    run_dir = ckpt.run_dir_of(step_dir)
    before = snapshot(run_dir)
    code, line = cli_line(
        capsys, "train", "log.progress=false", "train.max_steps=2", f"parallel.strategy={strategy}", "--resume",
        str(step_dir),
    )  # fmt: skip
    assert code == 2 and line.startswith(f"vitrain: error: checkpoint {step_dir}: its index .metadata declares {key}")
    assert snapshot(run_dir) == before


# slow: 72 s on a Zen 4; test_deepspeed.py's pickle test refuses a DeepSpeed file in the default run
@pytest.mark.slow
def test_a_deepspeed_file_holding_a_pickle_is_one_line_naming_it_without_torchs_advice(tmp_path, monkeypatch):
    if importlib.util.find_spec("deepspeed") is None:  # the runs below import it, this process need not
        pytest.skip("DeepSpeed is not installed: pip install 'vitrain[deepspeed]'")
    for name, value in torchrun_env(0, free_port(), world_size=1).items():  # DeepSpeed wants torchrun's variables
        monkeypatch.setenv(name, value)
    ds = ["name=ds", "data.source=synthetic", "data.synthetic_samples=64", "train.batch_size=16", "train.max_steps=1"]
    trained = run_cli("train", *tiny_overrides(tmp_path, *ds, "train.engine=deepspeed", "parallel.strategy=ddp"))
    assert trained.returncode == 0, trained.stderr
    run_dir, proof = tmp_path / "runs" / "ds", tmp_path / "ran"
    step_dir = next((run_dir / "checkpoints").glob("step_*"))
    torch.save({"cpu": Payload(proof)}, step_dir / "rng_rank0.pt")  # DeepSpeed itself never reads this file
    reseal_with_checksums(step_dir)
    before = snapshot(run_dir)
    line = refused_line("resume", step_dir, tmp_path, "train.max_steps=2")
    assert line == (
        f"vitrain: error: checkpoint file {step_dir / 'rng_rank0.pt'} refers to posix.system, which a checkpoint "
        "never holds: refusing to load it (loading it could run code); use checkpoints you wrote or got from a "
        "source you trust"
    )
    assert snapshot(run_dir) == before and not proof.exists()
    states = step_dir / ckpt.DEEPSPEED_DIR / "mp_rank_00_model_states.pt"
    torch.save({"module": {}, "payload": Payload(proof)}, states)  # refused before DeepSpeed unpickles it
    reseal_with_checksums(step_dir)
    line = refused_line("export", step_dir, tmp_path)
    assert line.startswith(f"vitrain: error: checkpoint file {states} holds more than tensors")
    assert "(UnpicklingError: it names posix.system)" in line and "weights_only" not in line
    assert not proof.exists() and not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------- untrusted configs
# A config vitrain reads from a checkpoint or run folder (meta.json, config.yaml) may name no module to import and no
# pipe: command to run (vitrain/trust.py) unless the command line gives the same value.

PAYLOAD = """import pathlib
pathlib.Path(__file__).with_name("imported").touch()
from vitrain.errors import DataError
def Source(cfg):
    raise DataError("the trusted payload source ran")
"""


@pytest.fixture
def payload(tmp_path, monkeypatch):
    """An importable module that leaves tmp_path/imported when imported; its import path (module:Source)."""
    name = f"payload_{uuid.uuid4().hex[:12]}"
    (tmp_path / f"{name}.py").write_text(PAYLOAD)
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{name}:Source"


def hand_over(step_dir, **changes):
    """Edit meta.json (dotted config keys, or `engine`) and recompute COMPLETE's checksums, as an attacker would."""
    meta_file = step_dir / ckpt.META_FILE
    meta = json.loads(meta_file.read_text())
    for key, value in changes.items():
        section, _, field = key.replace("__", ".").rpartition(".")
        node = meta if not section else meta["config"]
        for part in section.split(".") if section else ():
            node = node[part]
        node[field] = value
    meta_file.write_text(json.dumps(meta))
    files = {p.name: p.stat().st_size for p in step_dir.iterdir() if p.name != ckpt.COMPLETE_FILE}
    sums = ckpt.file_checksums(step_dir, sorted(files))
    (step_dir / ckpt.COMPLETE_FILE).write_text(json.dumps({"step": 1, "files": files, ckpt.CHECKSUM: sums}))
    assert main(["checkpoint", "verify", str(step_dir)]) == 0  # integrity holds: the checksums say nothing of trust


def cli_line(capsys, *args: str) -> tuple[int, str]:
    """Run the CLI in this process (the payload's folder is importable here); its exit code and stderr's one line."""
    capsys.readouterr()
    code = main(list(args))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) <= 1, err
    return code, err[0] if err else ""


COMMANDS = {
    "eval": lambda step, tmp: ["eval", str(step)],
    "export": lambda step, tmp: ["export", str(step), str(tmp / "out")],
    "resume": lambda step, tmp: ["train", "log.progress=false", "--resume", str(step)],
}


@pytest.mark.parametrize(
    "command, key",
    [("eval", "data.source"), ("eval", "model.name"), ("eval", "task.name"), ("eval", "train.engine"),
     ("eval", "engine"), ("export", "model.name"), ("export", "engine"), ("resume", "data.source")],
)  # fmt: skip
def test_a_handed_checkpoint_naming_an_import_path_is_refused_and_imports_nothing(
    tmp_path, step_dir, payload, capsys, command, key
):
    hand_over(step_dir, **{key.replace(".", "__"): payload})
    code, line = cli_line(capsys, *COMMANDS[command](step_dir, tmp_path))
    assert code == 2
    given = "train.engine" if key == "engine" else key
    assert line == (
        f"vitrain: error: {step_dir / ckpt.META_FILE} names {key}={payload}, an import path; vitrain imports no code "
        f"a checkpoint or run folder names: give {given}={payload} on the command line if you trust it"
    )
    assert not (tmp_path / "imported").exists() and not (tmp_path / "out").exists()


def test_an_import_path_the_command_line_gives_too_is_trusted(tmp_path, step_dir, payload, capsys):
    hand_over(step_dir, data__source=payload)
    code, line = cli_line(capsys, "eval", str(step_dir), f"data.source={payload}")
    assert (code, line) == (2, "vitrain: error: the trusted payload source ran")
    assert (tmp_path / "imported").exists()


def test_a_run_config_naming_an_import_path_is_refused_on_resume(tmp_path, step_dir, payload, capsys):
    saved = ckpt.run_dir_of(step_dir) / "config.yaml"
    saved.write_text(saved.read_text().replace("source: synthetic", f"source: {payload}"))
    before = sorted(p.name for p in saved.parent.iterdir())
    code, line = cli_line(capsys, *COMMANDS["resume"](step_dir, tmp_path))
    assert code == 2 and line.startswith(f"vitrain: error: {saved} names data.source={payload}, an import path")
    assert not (tmp_path / "imported").exists() and sorted(p.name for p in saved.parent.iterdir()) == before


def shard_list(tmp_path, proof) -> str:
    """A shard list as the auditor shipped it in a run folder: a real (empty) shard, then a pipe: command."""
    with tarfile.open(tmp_path / "a.tar", "w"):
        pass
    (tmp_path / "shards.txt").write_text(f"a.tar\npipe:touch {proof}; cat {tmp_path / 'a.tar'}\n")
    return str(tmp_path / "shards.txt")


@pytest.mark.parametrize("form", ["list file", "pipe root", "braces root", "braces in a list line"])
def test_a_handed_checkpoint_naming_a_pipe_command_is_refused_and_runs_nothing(tmp_path, step_dir, capsys, form):
    proof = tmp_path / "ran"
    root = shard_list(tmp_path, proof)
    index = {}
    if form == "braces root":  # the reader expands braces first, then runs what starts with pipe:
        root = f"{{{tmp_path}/a.tar,pipe:touch {proof}; cat {tmp_path}/a.tar}}"
    if form == "braces in a list line":
        (tmp_path / "shards.txt").write_text(f"a.tar\npi{{pe}}:touch {proof}; cat {tmp_path / 'a.tar'}\n")
    if form == "pipe root":  # with an index that counts it, so that the command would run
        root, index = f"pipe:touch {proof}; cat {tmp_path}/a.tar", {"data__shard_index": str(tmp_path / "index.json")}
        counts = {"format": "vitrain-shards/1", "counts": {root: 4}, "classes": list("0123")}
        (tmp_path / "index.json").write_text(json.dumps(counts))
    hand_over(step_dir, data__source="shards", data__root=root, data__val_fraction=0.5, **index)
    code, line = cli_line(capsys, "eval", str(step_dir))
    assert code == 2 and f"{step_dir / ckpt.META_FILE} names data.root={root}, a sh" in line
    assert f"vitrain runs no command a checkpoint or run folder names: give data.root={root} on the command" in line
    assert not proof.exists()


def test_a_run_config_naming_a_pipe_root_is_refused_on_resume(tmp_path, step_dir, capsys):
    proof = tmp_path / "ran"
    saved = ckpt.run_dir_of(step_dir) / "config.yaml"
    text = saved.read_text().replace("source: synthetic", "source: shards")
    saved.write_text(text.replace("root: ''", f"root: '{shard_list(tmp_path, proof)}'"))
    code, line = cli_line(capsys, *COMMANDS["resume"](step_dir, tmp_path))
    assert (
        code == 2
        and line.startswith(f"vitrain: error: {saved} names data.root=")
        and "a shard list naming a shell command (pipe:touch" in line
    )
    assert not proof.exists()


def test_a_pipe_root_the_command_line_gives_too_gets_past_the_trust_check(tmp_path, step_dir, capsys):
    root = f"pipe:cat {tmp_path}/a.tar"
    hand_over(step_dir, data__source="shards", data__root=root)
    code, line = cli_line(capsys, "eval", str(step_dir), f"data.root={root}")
    assert code == 2 and "pipe: shards need their sample counts up front" in line  # the shard reader's own check


def test_the_library_refuses_what_a_checkpoint_names_too(tmp_path, step_dir, payload):
    hand_over(step_dir, data__source=payload, engine=payload)
    meta = ckpt.read_meta(step_dir)
    with pytest.raises(ConfigError, match=f"names data.source={payload}, an import path"):
        config_from_dict(meta["config"], step_dir / ckpt.META_FILE)
    cfg = config_from_dict(meta["config"], step_dir / ckpt.META_FILE, {"data.source": payload})  # the user's value
    assert cfg.data.source == payload and (tmp_path / "imported").exists()
    model = create_model(cfg.model)
    with pytest.raises(ConfigError, match=f"names engine={payload}, an import path"):
        load_model_weights(step_dir, model)


def test_a_teachers_checkpoint_naming_an_import_path_is_refused_unless_the_run_names_it_too(
    tmp_path, step_dir, payload
):
    from vitrain.tasks.distill import load_teacher

    hand_over(step_dir, model__name=payload)
    student = tiny_config(tmp_path / "runs", "student")
    student.train.distill.teacher = str(step_dir)
    with pytest.raises(ConfigError, match=f"names model.name={payload}, an import path; .*register it"):
        load_teacher(student)
    assert not (tmp_path / "imported").exists()
    student.model.name = payload  # the run's own config names it: the user vouched for it
    with pytest.raises(DataError, match="the trusted payload source ran"):  # past the trust check: built
        load_teacher(student)


def test_every_import_path_and_command_a_saved_config_names_is_in_the_one_line():
    from vitrain import trust

    raw = {"model": {"name": "a_mod:Model"}, "task": {"name": "b_mod:Task"}, "data": {"root": "pipe:cat x.tar"}}
    with pytest.raises(ConfigError) as refused:
        trust.check_config(raw, "meta.json", {"task.name": "b_mod:Task"})  # the user typed task.name
    assert str(refused.value) == (
        "meta.json names model.name=a_mod:Model, an import path; data.root=pipe:cat x.tar, a shell command "
        "(pipe:cat x.tar); vitrain imports no code and runs no command a checkpoint or run folder names: give "
        "model.name=a_mod:Model data.root=pipe:cat x.tar on the command line if you trust it"
    )


def test_a_relative_shard_list_read_from_the_training_folder_is_checked_there_too(tmp_path, step_dir, capsys):
    # eval reads a relative data.root from meta.json's `cwd` when it names nothing here; the pipe: line in the list
    # file there is refused as an absolute path's is (it ran before the moved path was checked again).
    proof = tmp_path / "ran"
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    shard_list(shipped, proof)  # shipped/shards.txt: a shard, then "pipe:touch ran ..."
    hand_over(step_dir, data__source="shards", data__root="shards.txt", data__val_fraction=0.5, cwd=str(shipped))
    here = tmp_path / "elsewhere"
    here.mkdir()
    cwd = os.getcwd()
    os.chdir(here)
    try:
        code, line = cli_line(capsys, "eval", str(step_dir))
    finally:
        os.chdir(cwd)
    assert code == 2 and "pipe:" in line and not proof.exists()
    hand_over(step_dir, cwd="shipped")  # a relative `cwd` (meta.json is anyone's to edit) is not followed at all
    os.chdir(tmp_path)
    try:
        code, line = cli_line(capsys, "eval", str(step_dir))
    finally:
        os.chdir(cwd)
    assert code == 2 and not proof.exists()
