"""Tiny clips written by the tests themselves: frame folders (PNG, lossless) and video files (PyAV)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
from PIL import Image

from tests.conftest import TINY_MODEL, model_overrides

# The suite's tiny ViT over 4-frame clips of 16x16 RGB in 2x4x4 tubelets, two classes: as model.* overrides.
VIDEO_MODEL = dataclasses.replace(TINY_MODEL, in_chans=3, num_classes=2, num_frames=4, tubelet_size=2)
VIDEO_OVERRIDES = ["model.name=video_vit", *model_overrides(VIDEO_MODEL, ("image_size", "patch_size", "in_chans",
                   "num_classes", "width", "depth", "heads", "num_frames", "tubelet_size"))]  # fmt: skip


def frame_value(clip: int, frame: int) -> int:
    """The grey level of frame `frame` of clip `clip`: every frame of every clip tells which it is."""
    return (clip * 37 + frame * 5) % 256


def clip_pixels(clip: int, frames: int, size: int = 16) -> np.ndarray:
    """(frames, size, size, 3) uint8: frame f of clip c filled with frame_value(c, f), its class in a bright row."""
    video = np.stack([np.full((size, size, 3), frame_value(clip, f), np.uint8) for f in range(frames)])
    video[:, clip % 2 * (size // 2), :, :] = 255  # the class: where the bright row is
    return video


def write_frames(folder: Path, video: np.ndarray, first: int = 0, skip: int | None = None) -> None:
    """folder/NNN.png per frame, numbered from `first`; `skip`: a frame number left out (a gap)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, frame in enumerate(video):
        if first + i != skip:
            Image.fromarray(frame).save(folder / f"{first + i:03d}.png")


def write_video(path: Path, video: np.ndarray, fps: int = 25) -> None:
    """An H.264 .mp4 (or .avi: MPEG-4 part 2) of the frames, encoded with PyAV."""
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    codec = "mpeg4" if path.suffix == ".avi" else "libx264"
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = video.shape[2], video.shape[1], "yuv420p"
        for frame in video:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def make_clip_tree(root: Path, actors: int = 4, frames: int = 10, files: bool = False) -> list[str]:
    """root/<class>/actor<K>_<c> for classes a and b, K < actors, copies c in 0, 1: frame folders, or .mp4 files
    with `files`; returns the clip paths in the order the clip number of clip_pixels counts them."""
    names = []
    for k in range(actors):
        for copy in (0, 1):
            for cls in ("a", "b"):
                clip = len(names)  # even clips are class a, odd ones class b
                path = root / cls / f"actor{k}_{copy}"
                video = clip_pixels(clip, frames)
                if files:
                    write_video(path.with_suffix(".mp4"), video)
                else:
                    write_frames(path, video)
                names.append(str(path.relative_to(root)))
    return names
