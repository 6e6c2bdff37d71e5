"""data.source=video: decoding, splits, temporal sampling, augmentation across frames, bad clips, resume."""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import shared_data
from tests.data_helpers import jpeg_bytes, zip_tree
from tests.video_helpers import VIDEO_OVERRIDES, clip_pixels, frame_value, make_clip_tree, write_frames, write_video
from vitrain.config import load_config
from vitrain.data.augment import BatchAugment
from vitrain.data.loader import BatchLoader, Position
from vitrain.data.video import video_source
from vitrain.errors import ConfigError, DataError

needs_av = pytest.mark.skipif(
    importlib.util.find_spec("av") is None, reason="PyAV is absent: pip install 'vitrain[video]'"
)


def video_cfg(root: Path, *extra: str):
    return load_config(
        overrides=[
            *VIDEO_OVERRIDES,
            "data.source=video",
            f"data.root={root}",
            "data.video_frames=true",
            "data.val_match=actor3_",
            "data.decode_workers=1",
            "task.eval_clips=3",
            *extra,
        ]  # fmt: skip
    )


@pytest.fixture
def frame_tree(tmp_path: Path) -> Path:
    make_clip_tree(tmp_path / "clips")
    return tmp_path / "clips"


def test_frame_folders_become_clips_labelled_by_their_folder_and_split_by_val_match(frame_tree):
    train, val = video_source(video_cfg(frame_tree))
    assert train.classes == ["a", "b"]
    assert (train.videos, val.videos) == (12, 4)  # actors 0-2 train, actor 3's four clips (both copies) held out
    assert all("actor3_" in n for n in val.names) and not any("actor3_" in n for n in train.names)
    assert train.labels.tolist() == [0 if n.startswith("a/") else 1 for n in train.names]
    assert train.lengths.tolist() == [10] * 12
    assert len(val) == 4 * 3  # three clips per validation video


def test_a_zip_of_the_tree_reads_as_the_folder_does(frame_tree, tmp_path):
    folder = video_source(video_cfg(frame_tree))
    zipped = video_source(video_cfg(zip_tree(frame_tree, tmp_path / "clips.zip")))
    for a, b in zip(folder, zipped, strict=True):
        assert [n.removeprefix("data/") for n in b.names] == a.names
        assert torch.equal(a.frames, b.frames)


def test_split_folders_separate_train_and_val_without_a_regex(tmp_path):
    make_clip_tree(tmp_path / "train", actors=2)
    make_clip_tree(tmp_path / "val", actors=1)
    train, val = video_source(video_cfg(tmp_path, "data.val_match=", "data.val_split=val"))
    assert (train.videos, val.videos) == (8, 4)
    assert all(n.startswith("val/") for n in val.names)


def test_evaluation_clips_are_uniformly_spaced_and_the_centre_one_alone(frame_tree):
    _, val = video_source(video_cfg(frame_tree, "data.frame_stride=2"))
    first = int(val.starts[0])
    # 10 frames, a clip spans (4 - 1) x 2 + 1 = 7: starts 0, 1.5 -> 2 (round half to even), 3
    assert (val.frame_index(torch.arange(3)) - first).tolist() == [[0, 2, 4, 6], [2, 4, 6, 8], [3, 5, 7, 9]]
    centre = val.sampled(1, random=False)
    assert (centre.frame_index(torch.tensor([0])) - first).tolist() == [[1, 3, 5, 7]]


def test_a_clip_reads_its_frames_in_order_stacked_on_the_channel_axis(frame_tree):
    _, val = video_source(video_cfg(frame_tree))
    clips, labels = val.read(torch.tensor([0]))  # the first clip of the first validation video
    assert clips.shape == (1, 4 * 3, 16, 16)
    assert val.names[0] == "a/actor3_0"
    clip = (3 * 2 + 0) * 2 + 0  # make_clip_tree numbers clips by (actor, copy, class)
    values = clips[0, 0::3, 4, 4].tolist()  # channel 0 of each frame, away from the bright row
    assert values == [frame_value(clip, f) for f in range(4)]
    assert labels.tolist() == [0]


def test_training_starts_follow_the_generator_and_stay_in_the_video(frame_tree):
    train, _ = video_source(video_cfg(frame_tree))
    rows = torch.arange(12)
    a = train.frame_index(rows, torch.Generator().manual_seed(1))
    b = train.frame_index(rows, torch.Generator().manual_seed(1))
    c = train.frame_index(rows, torch.Generator().manual_seed(2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    offsets = a - train.starts[:, None]
    assert (offsets[:, 1:] - offsets[:, :-1] == 1).all() and (offsets >= 0).all() and (offsets < 10).all()


def test_a_video_shorter_than_the_clip_loops_from_its_start(tmp_path):
    for k in range(2):
        write_frames(tmp_path / "a" / f"actor{k}_0", clip_pixels(0, 3))
        write_frames(tmp_path / "b" / f"actor{k}_0", clip_pixels(1, 3))
    train, _ = video_source(video_cfg(tmp_path, "data.val_match=actor1_"))
    assert (train.frame_index(torch.tensor([0]), torch.Generator()) - train.starts[0]).tolist() == [[0, 1, 2, 0]]


def test_flip_and_crop_move_every_frame_of_a_clip_alike(frame_tree):
    train, _ = video_source(video_cfg(frame_tree))
    static = train.frames[train.starts[:6]].repeat(1, 4, 1, 1)  # six clips of one frame repeated
    data = dataclasses.replace(load_config().data, hflip=0.5, crop_padding=3)
    augment = BatchAugment(data, 3, True, 16, 2, frames=4)
    out, _ = augment(static, torch.zeros(6, dtype=torch.long), torch.Generator().manual_seed(0))
    frames = out.view(6, 4, 3, 16, 16)
    assert all(torch.equal(frames[:, 0], frames[:, t]) for t in range(1, 4))
    assert not torch.equal(frames[:, 0], augment.shift[:, :3] + static[:, :3] * augment.scale[:, :3])  # it did move


def test_a_resumed_epoch_reads_the_clips_the_whole_epoch_read(frame_tree):
    train, _ = video_source(video_cfg(frame_tree))
    augment = BatchAugment(load_config().data, 3, True, 16, 2, frames=4)
    loader = BatchLoader(train, 4, augment, torch.device("cpu"), shuffle=True, seed=3, prefetch=0)
    whole = list(loader.epoch(1))
    rest = list(loader.epoch(1, Position(epoch=1, samples=4)))
    assert len(rest) == len(whole) - 1
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(whole[1:], rest, strict=True))


def test_a_gap_in_a_frame_folder_is_one_line_naming_the_missing_frame(frame_tree):
    (frame_tree / "a" / "actor1_0" / "004.png").unlink()
    with pytest.raises(DataError) as error:
        video_source(video_cfg(frame_tree))
    message = str(error.value)
    assert "\n" not in message
    assert "a/actor1_0" in message and "frame 004.png is missing" in message and "data.skip_bad=0" in message


def test_skip_bad_skips_and_names_bad_clips_up_to_its_count(frame_tree):
    (frame_tree / "a" / "actor1_0" / "004.png").unlink()
    (frame_tree / "b" / "actor2_1" / "000.png").write_bytes(b"not a png")
    with pytest.raises(DataError, match="data.skip_bad=1 allows 1"):
        video_source(video_cfg(frame_tree, "data.skip_bad=1"))
    train, _ = video_source(video_cfg(frame_tree, "data.skip_bad=2"))
    assert train.videos == 10
    assert [where.rsplit("/", 2)[-2:] for where, _ in train.skipped.undecodable] == [
        ["a", "actor1_0"],
        ["b", "actor2_1"],
    ]


def test_a_val_match_that_leaves_no_validation_clip_is_refused(frame_tree):
    with pytest.raises(DataError, match=r"data.val_match='actor9_' matches no clip of 16"):
        video_source(video_cfg(frame_tree, "data.val_match=actor9_"))


def test_image_augmentations_of_colour_are_refused_for_clips(frame_tree):
    with pytest.raises(ConfigError, match="data.three_augment acts on one image's colours"):
        video_cfg(frame_tree, "data.three_augment=true")


@needs_av
def test_mp4_and_avi_files_decode_to_their_frames(tmp_path):
    write_video(tmp_path / "a" / "actor0_0.mp4", clip_pixels(0, 12))
    write_video(tmp_path / "b" / "actor0_0.avi", clip_pixels(1, 12))
    write_video(tmp_path / "a" / "actor1_0.mp4", clip_pixels(2, 12))
    write_video(tmp_path / "b" / "actor1_0.mp4", clip_pixels(3, 12))
    train, val = video_source(video_cfg(tmp_path, "data.video_frames=false", "data.val_match=actor1_"))
    assert train.names == ["a/actor0_0.mp4", "b/actor0_0.avi"] and train.lengths.tolist() == [12, 12]
    decoded = train.frames[:12, 0, 4, 4].float().numpy()  # lossy codecs: close to the grey levels written
    assert np.abs(decoded - [frame_value(0, f) for f in range(12)]).max() <= 12  # H.264 at 16x16 is coarse
    assert decoded[-1] - decoded[0] > 40  # in the order written


@needs_av
@pytest.mark.parametrize("content, reason", [(b"", "empty (0 bytes)"), (b"\x00garbage" * 50, "cannot decode video")])
def test_an_unreadable_or_empty_video_is_one_line_naming_it(tmp_path, content, reason):
    make_clip_tree(tmp_path, actors=2, frames=4, files=True)
    (tmp_path / "b" / "actor0_1.mp4").write_bytes(content)
    with pytest.raises(DataError) as error:
        video_source(video_cfg(tmp_path, "data.video_frames=false", "data.val_match=actor1_"))
    message = str(error.value)
    assert "\n" not in message and "b/actor0_1.mp4" in message and reason in message


@needs_av
@pytest.mark.parametrize("fmt, said", [("JPEG", "JPEG"), ("PNG", "PNG"), ("GIF", "GIF, one frame")])
def test_an_image_named_as_a_video_is_a_bad_clip_not_a_one_frame_one(tmp_path, fmt, said):
    # FFmpeg opens a lone image as a one-frame stream (jpeg_pipe, png_pipe, gif): it decoded, and trained as a still
    # clip. An animated GIF stays a video (below).
    make_clip_tree(tmp_path, actors=2, frames=4, files=True)
    (tmp_path / "b" / "actor0_1.mp4").write_bytes(jpeg_bytes(128, fmt))
    with pytest.raises(DataError) as error:
        video_source(video_cfg(tmp_path, "data.video_frames=false", "data.val_match=actor1_"))
    message = str(error.value)
    assert "\n" not in message and "b/actor0_1.mp4" in message and f"is an image ({said}), not a video" in message
    assert "data.skip_bad=0" in message
    train, _ = video_source(video_cfg(tmp_path, "data.video_frames=false", "data.val_match=actor1_", "data.skip_bad=1"))
    assert "b/actor0_1.mp4" not in train.names and train.videos == 3
    assert [where.rsplit("/", 2)[-2:] for where, _ in train.skipped.undecodable] == [["b", "actor0_1.mp4"]]


@needs_av
def test_an_animated_gif_under_a_video_name_is_a_video(tmp_path):
    make_clip_tree(tmp_path, actors=2, frames=4, files=True)
    frames = [Image.fromarray(np.full((8, 8, 3), 40 * k, np.uint8)) for k in range(3)]
    out = io.BytesIO()
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:])
    (tmp_path / "b" / "actor0_1.mp4").write_bytes(out.getvalue())
    train, _ = video_source(video_cfg(tmp_path, "data.video_frames=false", "data.val_match=actor1_"))
    assert train.lengths[train.names.index("b/actor0_1.mp4")].item() == 3


@needs_av
def test_a_real_video_shorter_than_the_clip_is_kept_and_loops(tmp_path):
    # Short videos are legitimate (padding by looping, as SlowFast's loader does): only non-videos are refused.
    write_video(tmp_path / "a" / "actor0_0.mp4", clip_pixels(0, 2))
    write_video(tmp_path / "b" / "actor0_0.mp4", clip_pixels(1, 2))
    write_video(tmp_path / "a" / "actor1_0.mp4", clip_pixels(2, 12))
    write_video(tmp_path / "b" / "actor1_0.mp4", clip_pixels(3, 12))
    train, _ = video_source(video_cfg(tmp_path, "data.video_frames=false", "data.val_match=actor1_"))
    assert train.lengths.tolist() == [2, 2]
    assert (train.frame_index(torch.tensor([0]), torch.Generator()) - train.starts[0]).tolist() == [[0, 1, 0, 1]]


@needs_av
@pytest.mark.slow  # decodes the whole real set twice
def test_weizmann_splits_by_actor_and_its_videos_match_its_frame_folders():
    root = shared_data("weizmann4-video.zip")
    overrides = ["model.image_size=32", "model.patch_size=8", "model.num_classes=4", "data.val_match=actor[678]_"]
    videos = video_source(video_cfg(root, *overrides, "data.video_frames=false"))
    frames = video_source(video_cfg(root, *overrides, "data.video_frames=true"))
    for split, expected in zip(videos, (48, 24), strict=True):  # 4 actions x 6 (or 3) actors x 2 copies
        assert split.videos == expected and split.classes == ["bend", "jack", "wave1", "wave2"]
    held_out = {re.search(r"actor\d", n).group(0) for n in videos[1].names}
    assert held_out == {"actor6", "actor7", "actor8"}
    for a, b in zip(videos, frames, strict=True):
        assert [Path(n).stem for n in a.names] == [Path(n).name for n in b.names]
        assert torch.equal(a.lengths, b.lengths) and torch.equal(a.labels, b.labels)
        # The JPEG frames and the H.264 decode differ by compression only.
        assert (a.frames.float() - b.frames.float()).abs().mean() < 12
