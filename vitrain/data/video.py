"""Video clips as a data source (`data.source=video`): files decoded with PyAV or frame folders, sampled in time.

Layouts (docs/video.md), under data.root, a folder or a .zip of one, at any depth:

    <class>/<clip>.mp4|.avi|.mkv|.mov|.webm      video files (the default)
    <class>/<clip>/<NNN>.jpg|.png                frame folders, numbered without gaps (data.video_frames=true)

The class is the folder holding the clip. The validation clips are those whose path matches `data.val_match` (a
regex, e.g. `actor[678]_`); else those under a folder named `data.val_split` (training ones under `data.train_split`),
as Kinetics and UCF101 trees are usually laid out; else `data.val_fraction` of the clips, held out by a fixed seed.

Why PyAV: its wheels on PyPI carry FFmpeg inside (no system FFmpeg, every common codec), it is maintained by the
FFmpeg-Python community with releases for each new Python, and it decodes frame by frame into numpy. decord, the
other common choice, has had no release since 2022 and no wheels for current Pythons.

Every clip is decoded once, all its frames at model.image_size (short side resized, centre crop), into one uint8
tensor, as the folder source holds images: fine for data sets of a few GB of pixels (Weizmann, UCF101 at 112 px on
a large machine), not for Kinetics at full size (docs/video.md says what is missing). A read then gathers frames:
model.num_frames of them, data.frame_stride apart, from a random start in training (drawn from the loader's
per-batch generator, so a resume replays it) and from `clips` uniformly spaced starts at evaluation. A video shorter
than the span loops from its start again (padding by looping, as SlowFast's loader does).
"""

from __future__ import annotations

import io
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import numpy as np
import torch
import torch.nn.functional as F

from vitrain.config import Config
from vitrain.data.names import index_names
from vitrain.data.shards import IMAGE_EXTS, VIDEO_EXTS, BadSample, Sample
from vitrain.data.sources import IMAGE_SUFFIXES, SPLIT_SEED, ImageTree, Skipped, decode_pool, file_reader
from vitrain.errors import ConfigError, DataError

VIDEO_SUFFIXES = (".mp4", ".avi", ".mkv", ".mov", ".webm")


@dataclass
class ClipSet:
    """Videos in memory and how clips are cut from them: one row per (video, clip) pair, `clips` rows per video.

    `frames` (all videos' frames one after another, (F, C, H, W) uint8), `starts` and `lengths` (each video's first
    frame in `frames` and its frame count), `labels` and `names` per video. `random`: a training set, whose reads draw
    each clip's start from the generator the loader passes (`draws_on_read`).
    """

    frames: torch.Tensor
    starts: torch.Tensor
    lengths: torch.Tensor
    labels: torch.Tensor
    classes: list[str]
    names: list[str]
    num_frames: int
    stride: int = 1
    clips: int = 1
    random: bool = False
    skipped: Skipped = field(default_factory=Skipped)

    @property
    def draws_on_read(self) -> bool:
        return self.random

    @property
    def videos(self) -> int:
        return self.labels.shape[0]

    @property
    def channels(self) -> int:
        return self.frames.shape[1]

    def __len__(self) -> int:
        return self.videos * self.clips

    def video_of(self, rows: torch.Tensor) -> torch.Tensor:
        return rows // self.clips

    def frame_index(self, rows: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """(B, num_frames) rows of `frames` of each row's clip: a random start in training, else clip k of `clips`
        uniformly spaced over the video (the centre one when clips=1); frames past the end loop to the start."""
        video = self.video_of(rows)
        draws = torch.rand(len(rows), generator=generator) if self.random else None
        offsets = clip_offsets(self.lengths[video], self.num_frames, self.stride, rows % self.clips, self.clips, draws)
        return self.starts[video][:, None] + offsets

    def read(self, index: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Clips (B, T*C, H, W) uint8, frames stacked on the channel axis (what the image augmentation moves as one),
        and their labels."""
        frames = self.frames[self.frame_index(index, generator)]  # (B, T, C, H, W)
        return frames.flatten(1, 2), self.labels[self.video_of(index)]

    def subset(self, videos: torch.Tensor) -> ClipSet:
        """The given videos (their frames stay shared)."""
        return ClipSet(self.frames, self.starts[videos], self.lengths[videos], self.labels[videos], self.classes,
                       [self.names[i] for i in videos.tolist()], self.num_frames, self.stride, self.clips,
                       self.random, self.skipped)  # fmt: skip

    def sampled(self, clips: int, random: bool) -> ClipSet:
        """The same videos cut `clips` per video, at random (training) or uniformly spaced (evaluation)."""
        return ClipSet(self.frames, self.starts, self.lengths, self.labels, self.classes, self.names,
                       self.num_frames, self.stride, clips, random, self.skipped)  # fmt: skip


def clip_offsets(
    lengths: torch.Tensor, num_frames: int, stride: int, k: torch.Tensor, clips: int, draws: torch.Tensor | None
) -> torch.Tensor:
    """(B, num_frames) frame numbers of clips in videos of `lengths` frames: the start at draws * (possible starts)
    when given (training: uniform in [0, 1)), else clip k of `clips` uniformly spaced (the centre one when clips=1);
    frames past the end loop to the start. The one temporal sampling of every clip source (ClipSet, ShardClips)."""
    room = (lengths - ((num_frames - 1) * stride + 1)).clamp(min=0)  # possible starts - 1
    if draws is not None:
        start = (draws * (room + 1)).floor().long()
    elif clips == 1:
        start = room // 2
    else:
        start = torch.round(k * room / (clips - 1)).long()
    offsets = start[:, None] + torch.arange(num_frames)[None, :] * stride
    return offsets % lengths[:, None]


def video_source(cfg: Config) -> tuple[ClipSet, ClipSet]:
    """(train, val) clips of data.root: train drawn at random, val `task.eval_clips` uniformly spaced per video."""
    d = cfg.data
    root = Path(d.root).expanduser()
    if not root.exists():
        raise DataError(f"data.root={root} does not exist; point it at a folder (or .zip) of <class>/<clip> videos")
    tree = ImageTree(root)
    clips = list_clips(tree, d.video_frames)
    if not clips:
        kind = (
            "frame folders (<class>/<clip>/NNN.jpg)" if d.video_frames else f"video files ({', '.join(VIDEO_SUFFIXES)})"
        )
        other = "data.video_frames=false" if d.video_frames else "data.video_frames=true"
        raise DataError(f"data.root={root} holds no {kind}; check the path, or set {other} for the other layout")
    names = list(clips)
    val_rows, train_rows = split_clips(names, cfg)
    classes = sorted({clip_class(names[i]) for i in train_rows})
    unknown = sorted({clip_class(names[i]) for i in val_rows} - set(classes))
    if unknown:
        raise DataError(
            f"data.root={root}: validation classes {unknown} have no training clips; move some or fix the split"
        )
    keep = train_rows + val_rows
    data = decode_clips(tree, [names[i] for i in keep], [clips[names[i]] for i in keep], classes, cfg)
    val_names = {names[i] for i in val_rows}
    is_val = torch.tensor([n in val_names for n in data.names], dtype=torch.bool)
    train = data.subset(torch.nonzero(~is_val).flatten()).sampled(1, random=True)
    val = data.subset(torch.nonzero(is_val).flatten()).sampled(cfg.task.eval_clips, random=False)
    return train, val


# Distinct random frames behind synthetic clips: each clip is a window of a shared pool, so data.synthetic_samples
# clips of 16 x 224 px cost this many frames of memory (7 MB at 224 px RGB), not 2.4 MB per clip.
SYNTHETIC_POOL_FRAMES = 256


def synthetic_clips(cfg: Config) -> tuple[ClipSet, ClipSet]:
    """data.source=synthetic for a model that takes clips: data.synthetic_samples random clips of model.num_frames
    frames and random labels, read through ClipSet as decoded videos are (the same gather and augmentation), for
    throughput benchmarks (`vitrain bench run ... --synthetic`), never for accuracy."""
    m = cfg.model
    gen = torch.Generator().manual_seed(cfg.train.seed)
    n, t = cfg.data.synthetic_samples, m.num_frames
    distinct = min(n, SYNTHETIC_POOL_FRAMES)
    pool = torch.randint(0, 256, (distinct + t - 1, m.in_chans, m.image_size, m.image_size), dtype=torch.uint8,
                         generator=gen)  # fmt: skip
    starts = torch.arange(n) % distinct
    labels = torch.randint(0, m.num_classes, (n,), generator=gen)
    classes = index_names(m.num_classes)
    data = ClipSet(pool, starts, torch.full((n,), t), labels, classes, [f"synthetic/{i}" for i in range(n)], t)
    n_val = max(1, n // 10)
    return data.subset(torch.arange(n_val, n)).sampled(1, random=True), data.subset(torch.arange(n_val))


@dataclass
class ShardClips:
    """How a shard sample becomes a clip (data.source=shards for a model that takes clips, one sample per clip): its
    video member (mp4, avi, ...) decoded with PyAV, or its numbered frame members (`000.jpg`, `001.jpg`, ...) in
    number order. Frames are sampled as ClipSet samples them (clip_offsets): in training from a random start drawn
    from (seed, epoch, sample key), so a resumed run reads the clips the whole run would have; at evaluation clip k
    of `clips` uniformly spaced. The chosen frames are resized and centre-cropped as data.source=video's are."""

    num_frames: int
    stride: int
    channels: int
    size: int
    clips: int = 1
    random: bool = False

    def decode(self, sample: Sample, k: int, seed: int, epoch: int) -> np.ndarray:
        """Clip k of the sample, (num_frames * channels, size, size) uint8, frame-major; BadSample when it has none."""
        try:
            video = _sample_frames(sample, self.channels == 1)
        except _BadClip as bad:
            raise BadSample(f"is not a usable clip: {bad}") from None
        draws = None
        if self.random:
            key = zlib.crc32(sample.key.encode())
            draws = torch.rand(1, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch * 10_007 + key))
        index = clip_offsets(torch.tensor([len(video)]), self.num_frames, self.stride, torch.tensor([k]), self.clips,
                             draws)[0]  # fmt: skip
        return _fit(video[index.numpy()], self.size).reshape(-1, self.size, self.size)


def _sample_frames(sample: Sample, gray: bool) -> np.ndarray:
    """(F, H, W, C) uint8 frames of a shard sample: its video member, else its numbered image members."""
    members = sample.members
    video = next((ext for ext in members if ext.rpartition(".")[2] in VIDEO_EXTS), None)
    if video is not None:
        return _read_video(members[video], gray)
    frames = [ext for ext in members if ext.rpartition(".")[2] in IMAGE_EXTS]
    if not frames:
        raise _BadClip(
            f"it has no video ({', '.join(VIDEO_EXTS)}) and no numbered frames (000.jpg, ...); members: "
            f"{', '.join(sorted(members)) or 'none'}"
        )
    return _read_frames(members.__getitem__, sample.key, frames, gray)


def clip_class(name: str) -> str:
    """A clip's class: the folder holding the video file or the frame folder."""
    return PurePosixPath(name).parent.name


def list_clips(tree: ImageTree, frames: bool) -> dict[str, list[str]]:
    """{clip path: its files}, in path order: a video file is one file; a frame folder its frames by name."""
    found: dict[str, list[str]] = {}
    for name in sorted(tree.names):
        if name.endswith("/") or "/" not in name or name.startswith("__MACOSX/"):
            continue
        suffix = PurePosixPath(name).suffix.lower()
        if not frames and suffix in VIDEO_SUFFIXES:
            found[name] = [name]
        elif frames and suffix in IMAGE_SUFFIXES and name.count("/") >= 2:
            found.setdefault(name.rsplit("/", 1)[0], []).append(name)
    return found


def split_clips(names: list[str], cfg: Config) -> tuple[list[int], list[int]]:
    """(val rows, train rows) of the clip paths: data.val_match, else split folders, else a seeded held-out share."""
    d = cfg.data
    if d.val_match:
        pattern = re.compile(d.val_match)
        val = [i for i, n in enumerate(names) if pattern.search(n)]
        if not val or len(val) == len(names):
            what = "no clip" if not val else "every clip"
            raise DataError(f"data.val_match={d.val_match!r} matches {what} of {len(names)}; it must leave both splits")
        held_out = set(val)
        return val, [i for i in range(len(names)) if i not in held_out]
    folders = [PurePosixPath(n).parts[:-2] for n in names]
    val = [i for i, parts in enumerate(folders) if d.val_split in parts]
    if val:
        train = [i for i, parts in enumerate(folders) if d.train_split in parts]
        if not train:
            raise DataError(
                f"data.root has a '{d.val_split}' folder but no '{d.train_split}' one; set data.train_split"
            )
        return val, train
    perm = torch.randperm(len(names), generator=torch.Generator().manual_seed(SPLIT_SEED)).tolist()
    n_val = max(1, round(d.val_fraction * len(names)))
    return sorted(perm[:n_val]), sorted(perm[n_val:])


def decode_clips(tree: ImageTree, names: list[str], files: list[list[str]], classes: list[str], cfg: Config) -> ClipSet:
    """Every clip's frames at model.image_size; up to data.skip_bad clips that do not decode are skipped (named),
    one more is a DataError naming it."""
    d, m = cfg.data, cfg.model
    gray = m.in_chans == 1
    jobs = [(str(tree.root), tree.is_zip, clip, clip_files, d.video_frames, gray, m.image_size)
            for clip, clip_files in zip(names, files, strict=True)]  # fmt: skip
    workers = max(1, d.decode_workers)
    if workers == 1 or len(jobs) < 8:
        results = [_decode_job(job) for job in jobs]
    else:
        with decode_pool(workers) as pool:
            results = list(pool.map(_decode_job, jobs, chunksize=max(1, len(jobs) // (4 * workers))))
    bad = [(tree.location(name), why) for name, (_, why) in zip(names, results, strict=True) if why]
    if len(bad) > d.skip_bad:
        where, why = bad[d.skip_bad]
        allowed = f"data.skip_bad={d.skip_bad} allows {d.skip_bad}" if d.skip_bad else "data.skip_bad=0 allows none"
        raise DataError(f"{where}: {why}; fix or remove it, or let the run skip bad clips ({allowed})")
    kept = [i for i, (_, why) in enumerate(results) if not why]
    videos = [torch.from_numpy(results[i][0]) for i in kept]
    lengths = torch.tensor([v.shape[0] for v in videos], dtype=torch.long)
    starts = torch.cumsum(lengths, 0) - lengths
    labels = torch.tensor([classes.index(clip_class(names[i])) for i in kept], dtype=torch.long)
    return ClipSet(torch.cat(videos), starts, lengths, labels, classes, [names[i] for i in kept], m.num_frames,
                   d.frame_stride, skipped=Skipped(undecodable=bad))  # fmt: skip


def _decode_job(job: tuple) -> tuple[np.ndarray | None, str]:
    """(frames (F, C, size, size) uint8, "") of one clip, or (None, why it cannot be used)."""
    root, is_zip, clip, files, frames, gray, size = job
    try:
        with file_reader(root, is_zip) as read:
            video = _read_frames(read, clip, files, gray) if frames else _read_video(read(files[0]), gray)
    except _BadClip as bad:
        return None, str(bad)
    return _fit(video, size), ""


class _BadClip(Exception):
    pass


def _read_video(data: bytes, gray: bool) -> np.ndarray:
    """All frames of a video file, (F, H, W, C) uint8, decoded with PyAV."""
    import av

    if not data:
        raise _BadClip("the video file is empty (0 bytes)")
    try:
        with av.open(io.BytesIO(data)) as container:
            demuxer = container.format.name
            image = _image_format(demuxer)
            if image:
                raise _BadClip(f"the file is an image ({image}), not a video")
            if not container.streams.video:
                raise _BadClip("the file has no video stream")
            fmt = "gray" if gray else "rgb24"
            frames = [f.to_ndarray(format=fmt) for f in container.decode(container.streams.video[0])]
    except av.FFmpegError as error:
        raise _BadClip(f"cannot decode video ({type(error).__name__}: {error.strerror or error})") from None
    if not frames:
        raise _BadClip("the video has no frames (zero length)")
    if len(frames) == 1 and demuxer in STILL_OR_ANIMATED:  # a still GIF is an image, as a JPEG is
        raise _BadClip(f"the file is an image ({demuxer.upper()}, one frame), not a video")
    video = np.stack(frames)
    return video[..., None] if gray else video


# FFmpeg's demuxers of image formats that may hold an animation: with several frames a clip, with one an image.
STILL_OR_ANIMATED = ("gif", "apng")


def _image_format(demuxer: str) -> str:
    """The image kind ("JPEG", "PNG", ...) when FFmpeg's demuxer is one of its still-image readers (jpeg_pipe,
    png_pipe, image2, ...), else "". FFmpeg opens a lone image as a one-frame video stream, so an image under a video
    name decoded and trained as a still clip. yuv4mpegpipe (raw video) does not end in _pipe: it stays a video."""
    if demuxer in ("image2", "image2pipe"):
        return "image2"
    return demuxer.removesuffix("_pipe").upper() if demuxer.endswith("_pipe") else ""


def _read_frames(read, clip: str, files: list[str], gray: bool) -> np.ndarray:
    """A frame folder's images in number order, (F, H, W, C) uint8; a missing number is a gap naming the frame."""
    from PIL import Image

    numbers = []
    for name in files:
        stem = PurePosixPath(name).stem
        digits = re.search(r"(\d+)$", stem)
        if digits is None:
            raise _BadClip(f"frame {PurePosixPath(name).name} has no frame number (frames are named NNN.jpg)")
        numbers.append(int(digits.group(1)))
    order = sorted(range(len(files)), key=lambda i: numbers[i])
    first = numbers[order[0]]
    for expected, i in enumerate(order, start=first):
        if numbers[i] != expected:
            width = len(PurePosixPath(files[i]).stem)
            missing = f"{expected:0{width}d}{PurePosixPath(files[i]).suffix}"
            raise _BadClip(
                f"frame folder has a gap: frame {missing} is missing (frames {first} to {numbers[order[-1]]})"
            )
    images = []
    for i in order:
        try:
            with Image.open(io.BytesIO(read(files[i]))) as image:
                images.append(np.asarray(image.convert("L" if gray else "RGB")))
        except Exception as error:  # PIL raises many types for bad files
            raise _BadClip(f"frame {PurePosixPath(files[i]).name} does not decode ({type(error).__name__})") from None
    if len({a.shape for a in images}) > 1:
        raise _BadClip("frames of different sizes in one folder")
    video = np.stack(images)
    return video[..., None] if gray else video


def _fit(video: np.ndarray, size: int) -> np.ndarray:
    """(F, H, W, C) -> (F, C, size, size): the short side resized to `size` (antialiased bilinear), centre crop."""
    x = torch.from_numpy(video).permute(0, 3, 1, 2)
    h, w = x.shape[-2:]
    if (h, w) != (size, size):
        scale = size / min(h, w)
        new = (max(size, round(h * scale)), max(size, round(w * scale)))
        x = F.interpolate(x.float(), size=new, mode="bilinear", antialias=True, align_corners=False)
        top, left = (new[0] - size) // 2, (new[1] - size) // 2
        x = x[..., top : top + size, left : left + size].round().clamp(0, 255).to(torch.uint8)
    return x.contiguous().numpy()


def check(cfg: Config) -> None:
    """data.source=video's fields, and what it asks of the model and augmentation."""
    d, m = cfg.data, cfg.model
    if not d.root:
        raise ConfigError("data.source=video needs data.root=PATH (a folder or .zip of <class>/<clip> videos)")
    if d.frame_stride < 1:
        raise ConfigError(f"data.frame_stride={d.frame_stride} must be >= 1 (1: consecutive frames)")
    if d.val_match:
        try:
            re.compile(d.val_match)
        except re.error as error:
            raise ConfigError(f"data.val_match={d.val_match!r} is not a regular expression ({error})") from None
    if cfg.task.eval_clips < 1:
        raise ConfigError(f"task.eval_clips={cfg.task.eval_clips} must be >= 1 (1: the centre clip of each video)")
    if d.min_size:
        raise ConfigError(f"data.min_size={d.min_size}: progressive resizing is for images; set data.min_size=0")
    strong = [n for n in ("randaugment", "trivialaugment", "three_augment", "color_jitter", "random_erasing")
              if getattr(d, n)]  # fmt: skip
    if strong and m.num_frames > 1:
        raise ConfigError(
            f"data.{strong[0]} acts on one image's colours; clips stack their frames on the channel axis: turn it off "
            "for model.num_frames > 1 (crop, flip, resized crop and mixup apply to clips)"
        )
