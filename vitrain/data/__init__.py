"""Data: sources decoded to uint8 tensors or prepared memory maps, batched loading and on-device augmentation."""

from vitrain.config import Config
from vitrain.data.augment import BatchAugment
from vitrain.data.loader import BatchLoader
from vitrain.data.pipeline import build_loaders
from vitrain.data.prepared import PreparedSet, open_prepared
from vitrain.data.sources import ImageSet, build_datasets
from vitrain.data.strong import RandAugmentSpec
from vitrain.errors import ConfigError

__all__ = [
    "BatchAugment",
    "BatchLoader",
    "ImageSet",
    "PreparedSet",
    "build_datasets",
    "build_loaders",
    "check",
    "open_prepared",
]


def check(cfg: Config) -> None:
    """The data section (and what it asks of the model's input): one line naming the value and the fix."""
    m = cfg.model
    d = cfg.data
    if d.source == "folder" and not d.root:
        raise ConfigError("data.source=folder needs data.root=PATH (an ImageFolder tree or a .zip of one)")
    if len(d.mean) not in (1, m.in_chans) or len(d.std) not in (1, m.in_chans):
        raise ConfigError(
            f"data.mean={list(d.mean)} and data.std={list(d.std)} need 1 or model.in_chans={m.in_chans} values each; "
            f"set them to match, e.g. data.mean=[0.5] data.std=[0.5]"
        )
    if any(s <= 0 for s in d.std):
        raise ConfigError(f"data.std={list(d.std)} must be positive")
    if not 0.0 < d.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={d.val_fraction} must be between 0 and 1")
    if not 0.0 <= d.hflip <= 1.0:
        raise ConfigError(f"data.hflip={d.hflip} is a probability and must be in [0, 1]")
    if d.source == "detection" and cfg.task.name != "detection":
        raise ConfigError(
            f"data.source=detection reads boxes for task.name=detection, not task.name={cfg.task.name}; set both"
        )
    if d.source == "prepared" and not d.root:
        raise ConfigError("data.source=prepared needs data.root=PATH (a folder made by `vitrain data prepare`)")
    if d.loader == "plain" and d.source != "folder":
        raise ConfigError(
            f"data.loader=plain decodes image files per sample; it needs data.source=folder, not {d.source}"
        )
    if d.loader == "plain" and d.skip_bad:  # it decodes a file as a worker draws it: nothing to take its place
        raise ConfigError(
            f"data.skip_bad={d.skip_bad} skips undecodable files in the fast loader; data.loader=plain (the per-sample "
            "PIL baseline) stops at the first one: set data.loader=fast, or data.skip_bad=0"
        )
    if not 0.0 < d.rrc_scale[0] <= d.rrc_scale[1] <= 1.0:
        raise ConfigError(f"data.rrc_scale={list(d.rrc_scale)} must be area fractions with 0 < low <= high <= 1")
    if d.min_size and not (0 < d.min_size <= m.image_size and d.min_size % m.patch_size == 0):
        raise ConfigError(
            f"data.min_size={d.min_size} must be a multiple of model.patch_size={m.patch_size} and at most "
            f"model.image_size={m.image_size} (0 turns progressive resizing off)"
        )
    if not 0.0 <= d.size_ramp[0] <= d.size_ramp[1] <= 1.0:
        raise ConfigError(
            f"data.size_ramp={list(d.size_ramp)} must be fractions of the run with 0 <= start <= end <= 1"
        )
    if not 0.0 < d.rrc_ratio[0] <= d.rrc_ratio[1]:
        raise ConfigError(f"data.rrc_ratio={list(d.rrc_ratio)} must be aspect ratios with 0 < low <= high")
    for name in ("mixup_alpha", "cutmix_alpha", "prefetch", "loader_workers", "skip_bad", "crop_padding",
                 "decode_workers", "shuffle_buffer"):  # fmt: skip
        if getattr(d, name) < 0:
            raise ConfigError(f"data.{name}={getattr(d, name)} must be >= 0")
    if d.synthetic_samples <= 0:
        raise ConfigError(f"data.synthetic_samples={d.synthetic_samples} must be positive, e.g. 1024")
    if not 0.0 <= d.cutmix_prob <= 1.0:
        raise ConfigError(f"data.cutmix_prob={d.cutmix_prob} is a probability and must be in [0, 1]")
    _check_strong(cfg)
    if d.source == "video":
        from vitrain.data.video import check as check_video  # PyAV is imported only where clips are decoded

        check_video(cfg)


def _check_strong(cfg: Config) -> None:
    """Strong augmentation and repeated augmentation (data/strong.py, data/loader.py)."""
    d = cfg.data
    policies = [f"data.{name}" for name in ("randaugment", "trivialaugment", "three_augment") if getattr(d, name)]
    if len(policies) > 1:
        together = " and ".join(policies)
        raise ConfigError(f"{together} are on together; choose one policy (timm and DeiT apply one at a time)")
    if d.randaugment:
        RandAugmentSpec.parse(d.randaugment)
    if d.color_jitter is not None and not 0.0 <= d.color_jitter <= 1.0:
        raise ConfigError(f"data.color_jitter={d.color_jitter} must be in [0, 1] (DeiT III: 0.3), or null")
    if not 0.0 <= d.random_erasing <= 1.0:
        raise ConfigError(f"data.random_erasing={d.random_erasing} is a probability and must be in [0, 1] (DeiT: 0.25)")
    if d.repeated_aug < 1:
        raise ConfigError(f"data.repeated_aug={d.repeated_aug} must be >= 1 (1: off; DeiT: 3)")
    batched = {
        "randaugment": d.randaugment,
        "trivialaugment": d.trivialaugment,
        "three_augment": d.three_augment,
        "color_jitter": d.color_jitter,
        "random_erasing": d.random_erasing,
        "repeated_aug": d.repeated_aug > 1,
    }
    if d.loader == "plain" and any(batched.values()):
        name = next(name for name, on in batched.items() if on)
        raise ConfigError(
            f"data.{name} runs in the fast loader; data.loader=plain (the per-sample PIL baseline) has no such step: "
            "set data.loader=fast"
        )
