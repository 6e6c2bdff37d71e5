"""Clips from WebDataset shards (one sample per clip: a video file or its numbered frames, and a label)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli
from tests.data_helpers import jpeg_bytes
from tests.video_helpers import VIDEO_OVERRIDES, clip_pixels, make_clip_tree, write_video
from vitrain.config import load_config
from vitrain.data import build_loaders
from vitrain.data.shards import ShardWriter, read_samples
from vitrain.data.stream import shards_source
from vitrain.data.video import video_source

pytestmark = pytest.mark.skipif(importlib.util.find_spec("av") is None, reason="PyAV is absent: pip install av")

VAL = "actor3_"  # make_clip_tree's fourth actor, both copies: the validation videos


def clip_members(tree: Path, clip: str, frames: bool) -> dict[str, bytes]:
    """One shard sample's members for a clip of make_clip_tree: its .mp4 bytes unchanged, or its frames as NNN.png."""
    if not frames:
        return {"mp4": (tree / clip).with_suffix(".mp4").read_bytes()}
    return {path.name: path.read_bytes() for path in sorted((tree / clip).iterdir())}


def write_shards(tree: Path, out: Path, frames: bool = False, extra: dict[str, dict[str, bytes]] | None = None):
    """train-000000.tar and val-000000.tar (the clips matching VAL) of make_clip_tree's clips, one sample per clip;
    `extra`: more training samples by key (bad ones)."""
    names = make_clip_tree(tree, files=not frames)
    out.mkdir(parents=True)
    writers = {split: ShardWriter(str(out / f"{split}-000000.tar")) for split in ("train", "val")}
    for name in names:
        label = str("ab".index(Path(name).parent.name)).encode()
        split = "val" if VAL in name else "train"
        writers[split].write(name.replace("/", "_"), {**clip_members(tree, name, frames), "cls": label})
    for key, members in (extra or {}).items():
        writers["train"].write(key, members)
    for writer in writers.values():
        writer.close()
    return names


def overrides(tmp_path: Path, source: str, root: Path, *extra: str) -> list[str]:
    return [*VIDEO_OVERRIDES, "name=shards", "task.name=video", "task.eval_clips=3", f"data.source={source}",
            f"data.root={root}", f"data.val_match={VAL}", "data.val_split=val", "data.decode_workers=1",
            "data.frame_stride=2", "data.loader_workers=0", "train.batch_size=4", "train.max_steps=3",
            "train.threads=1", "precision.mode=fp32", "log.progress=false", "log.every_steps=1",
            f"log.out_dir={tmp_path / 'runs'}", *extra]  # fmt: skip


def cfg_for(tmp_path: Path, source: str, root: Path, *extra: str):
    return load_config(overrides=overrides(tmp_path, source, root, *extra))


@pytest.mark.parametrize("frames", [False, True], ids=["mp4", "frames"])
def test_evaluation_clips_from_shards_equal_the_folder_sources_clips(tmp_path, frames):
    names = write_shards(tmp_path / "clips", tmp_path / "shards", frames=frames)
    folder_flag = [f"data.video_frames={str(frames).lower()}"]
    _, folder_val = video_source(cfg_for(tmp_path, "video", tmp_path / "clips", *folder_flag))
    _, shard_val = shards_source(cfg_for(tmp_path, "shards", tmp_path / "shards"))
    assert (shard_val.videos, len(shard_val), shard_val.num_frames) == (4, 12, 4)  # 3 clips per validation video
    samples = list(read_samples(shard_val.index.urls[0]))
    assert len(samples) == 4
    for sample in samples:
        clip = next(n for n in names if n.replace("/", "_") == sample.key)
        video = folder_val.names.index(clip + ("" if frames else ".mp4"))
        for k in range(3):
            expected, label = folder_val.read(torch.tensor([video * 3 + k]))
            assert torch.equal(torch.from_numpy(shard_val.decode(sample, k, seed=0, epoch=0)), expected[0])
            assert sample.label == int(label)


def test_training_clips_from_shards_start_where_the_seed_epoch_and_key_say(tmp_path):
    write_shards(tmp_path / "clips", tmp_path / "shards")
    train, _ = shards_source(cfg_for(tmp_path, "shards", tmp_path / "shards", "data.frame_stride=1"))
    sample = next(iter(read_samples(train.index.urls[0])))
    first = train.decode(sample, 0, seed=0, epoch=0)
    assert first.shape == (4 * 3, 16, 16)
    assert (train.decode(sample, 0, seed=0, epoch=0) == first).all()  # a resumed run reads the same clip
    # 10 frames, 4-frame clips: 7 possible starts; over epochs the draw moves
    starts = {train.decode(sample, 0, seed=0, epoch=e)[0, 4, 4] for e in range(12)}
    assert len(starts) > 1


def test_a_video_tree_packed_to_shards_trains_from_the_cli_and_evaluates_whole_videos(tmp_path):
    names = make_clip_tree(tmp_path / "clips", files=True)
    done = run_cli("data", "pack", str(tmp_path / "clips"), str(tmp_path / "shards"), "--format", "shards", "--video",
                   "--val-match", VAL)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "packed train 12, test 4 samples of 2 classes" in done.stdout
    packed = [s for url in sorted((tmp_path / "shards").glob("*.tar")) for s in read_samples(str(url))]
    by_path = {json.loads(s.members["json"])["path"]: s for s in packed}
    assert sorted(by_path) == sorted(n + ".mp4" for n in names)
    assert by_path["b/actor1_0.mp4"].members["mp4"] == (tmp_path / "clips" / "b" / "actor1_0.mp4").read_bytes()
    assert by_path["b/actor1_0.mp4"].label == 1  # classes a, b in name order
    done = run_cli("train", *overrides(tmp_path, "shards", tmp_path / "shards", "data.val_split=test"))
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "runs" / "shards" / "summary.json").read_text())
    assert summary["steps"] == 3
    assert (summary["val_videos"], summary["val_samples"], summary["eval_clips"]) == (4, 12, 3)
    assert 0.0 <= summary["val_video_top1"] <= 1.0


@pytest.mark.parametrize(
    "key, members, says",
    [
        ("no_label", {"mp4": None}, "has no label"),
        ("broken", {"mp4": b"not a video at all" * 40, "cls": b"0"}, "is not a usable clip: cannot decode video"),
        ("an_image", {"mp4": jpeg_bytes(128), "cls": b"0"}, "is not a usable clip: the file is an image (JPEG)"),
    ],
)
def test_a_bad_clip_sample_is_one_line_naming_the_shard_and_key_exit_2(tmp_path, key, members, says):
    write_video(tmp_path / "good.mp4", clip_pixels(0, 10))
    good = {"mp4": (tmp_path / "good.mp4").read_bytes(), "cls": b"0"}
    members = {ext: raw if raw is not None else good[ext] for ext, raw in members.items()}
    # 12 training clips + 4 = 4 whole batches: every sample, the bad one too, is read in the first 4 steps
    extra = {key: members, **{f"good{i}": good for i in range(3)}}
    write_shards(tmp_path / "clips", tmp_path / "shards", extra=extra)
    done = run_cli("train", *overrides(tmp_path, "shards", tmp_path / "shards", "train.max_steps=4"))
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("vitrain: error")]
    assert len(errors) == 1 and f"sample {key} (" in errors[0] and "train-000000.tar" in errors[0], done.stderr
    assert says in errors[0]


def test_evaluation_rows_name_their_videos_with_two_loader_workers(tmp_path):
    write_shards(tmp_path / "clips", tmp_path / "shards")
    cfg = cfg_for(tmp_path, "shards", tmp_path / "shards", "data.loader_workers=2", "train.batch_size=5")
    _, val = build_loaders(cfg, torch.device("cpu"))
    labels_of_video = torch.tensor([s.label for s in read_samples(val.data.index.urls[0])])
    rows = val.order(0)
    # 4 videos x 3 clips in batches of 5, 5, 2 from workers 0, 1, 0; worker 0 reads rows 0-6, worker 1 rows 7-11
    assert rows.tolist() == [0, 1, 2, 3, 4, 7, 8, 9, 10, 11, 5, 6]
    seen = torch.cat([labels for _, labels in val.epoch(0)])
    assert torch.equal(seen, labels_of_video[val.data.video_of(rows)])


def test_a_clip_stream_resumed_mid_epoch_reads_the_clips_the_whole_epoch_read(tmp_path):
    write_shards(tmp_path / "clips", tmp_path / "shards")
    cfg = cfg_for(tmp_path, "shards", tmp_path / "shards", "data.prefetch=0", "data.hflip=0.5")
    train, _ = build_loaders(cfg, torch.device("cpu"))
    whole = list(train.epoch(1))
    rest = list(train.epoch(1, train.position(1, None, 1)))  # a checkpoint after the epoch's first batch
    assert len(whole) == 3 and len(rest) == 2
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(whole[1:], rest, strict=True))
