"""Strong augmentation of whole batches on the training device: RandAugment, TrivialAugment, 3-Augment, colour jitter
and random erasing, every image with its own ops and strengths.

Pixels are floats on the 0-255 scale, before normalization. A policy draws, per image, which op it takes and the op's
argument (an angle, a factor, a threshold) on the CPU from the batch's generator (a function of seed, epoch, batch and
rank: vitrain/data/loader.py), so a resumed run draws exactly what the uninterrupted one did, on any device. Each op
then runs once on the images that drew it (`Layer.apply`): a handful of batched kernels per op, never a loop over
images. The ops are deterministic functions of (images, arguments).

Op arguments and their ranges follow timm's `rand_augment_transform` (RandAugment), torchvision's
TrivialAugmentWide and DeiT III's 3-Augment; where vitrain differs, docs/augment.md says how.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vitrain.config import DataConfig
from vitrain.errors import ConfigError

# An op: (images (n, C, H, W) float in 0-255, one argument per image (n,) on the CPU, fill (C,) pixels) -> images.
OpFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _per_image(values: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return values.to(device=x.device, dtype=x.dtype).view(-1, 1, 1, 1)


def _gray(x: torch.Tensor) -> torch.Tensor:
    """(n, 1, H, W) luminance: ITU-R 601 weights for RGB (PIL's "L"), the channel mean otherwise (grey: itself)."""
    if x.shape[1] == 3:
        return 0.299 * x[:, 0:1] + 0.587 * x[:, 1:2] + 0.114 * x[:, 2:3]
    return x.mean(1, keepdim=True)


def _blend(degenerate: torch.Tensor, x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """PIL's ImageEnhance: degenerate + factor * (x - degenerate), clipped; factor 1 returns x exactly (lerp)."""
    return torch.lerp(degenerate.expand_as(x), x, _per_image(factor, x)).clamp_(0.0, 255.0)


# ---------------------------------------------------------------------------------------------- colour ops


def identity(x: torch.Tensor, arg: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    return x


def auto_contrast(x: torch.Tensor, arg: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """Each channel stretched so that its darkest pixel is 0 and its brightest 255 (a flat channel is kept)."""
    low, high = x.amin((2, 3), keepdim=True), x.amax((2, 3), keepdim=True)
    spread = high - low
    return torch.where(spread > 0, (x - low) * (255.0 / spread.clamp(min=1e-6)), x)


def equalize(x: torch.Tensor, arg: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """PIL's ImageOps.equalize per channel: the rounded levels mapped through their cumulative histogram."""
    n, c, h, w = x.shape
    levels = x.round().clamp(0, 255).long().view(n * c, h * w)
    offsets = 256 * torch.arange(n * c, device=x.device).view(-1, 1)
    hist = torch.bincount((levels + offsets).view(-1), minlength=256 * n * c).view(n * c, 256)
    top = hist.gather(1, levels.amax(1, keepdim=True))  # pixels at the brightest level present
    step = (h * w - top) // 255
    below = hist.cumsum(1) - hist  # pixels darker than each level
    lut = ((step // 2 + below) // step.clamp(min=1)).clamp(max=255)
    mapped = lut.gather(1, levels).to(x.dtype).view(n, c, h, w)
    return torch.where((step > 0).view(n, c, 1, 1), mapped, x)


def invert(x: torch.Tensor, arg: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    return 255.0 - x


def posterize(x: torch.Tensor, bits: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """The `bits` most significant bits of each rounded level kept (8 or more: unchanged)."""
    step = _per_image(2.0 ** (8 - bits.clamp(0, 8)), x)
    return torch.where(step > 1, torch.div(x.round().clamp(0, 255), step, rounding_mode="floor") * step, x)


def solarize(x: torch.Tensor, threshold: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """Levels at or above `threshold` inverted (256: unchanged)."""
    return torch.where(x >= _per_image(threshold, x), 255.0 - x, x)


def solarize_add(x: torch.Tensor, add: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """`add` added to the levels below 128, clipped at 255 (timm's SolarizeAdd)."""
    return torch.where(x < 128, (x + _per_image(add, x)).clamp(max=255.0), x)


def brightness(x: torch.Tensor, factor: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    return _blend(torch.zeros_like(x[:, :1]), x, factor)


def contrast(x: torch.Tensor, factor: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    return _blend(_gray(x).mean((2, 3), keepdim=True), x, factor)


def color(x: torch.Tensor, factor: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """Saturation: a blend with the image's luminance (factor 0: grey; a grey image is unchanged)."""
    return _blend(_gray(x), x, factor)


def grayscale(x: torch.Tensor, strength: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """Desaturation by `strength` (1: luminance in every channel, 0: unchanged)."""
    return color(x, 1.0 - strength, fill)


def sharpness(x: torch.Tensor, factor: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """A blend with PIL's SMOOTH filter of the image (the border pixels kept as they are)."""
    c = x.shape[1]
    kernel = torch.ones(3, 3, dtype=x.dtype, device=x.device)
    kernel[1, 1] = 5.0
    smooth = F.conv2d(x, (kernel / 13.0).expand(c, 1, 3, 3), groups=c)
    return _blend(F.pad(smooth, (1, 1, 1, 1)).where(_interior(x), x), x, factor)


def _interior(x: torch.Tensor) -> torch.Tensor:
    h, w = x.shape[-2:]
    inside = torch.zeros(h, w, dtype=torch.bool, device=x.device)
    inside[1:-1, 1:-1] = True
    return inside


def gaussian_blur(x: torch.Tensor, sigma: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """A separable Gaussian of standard deviation `sigma` pixels per image (PIL's radius; 0: unchanged), edges
    replicated; the per-image kernels run as one grouped convolution."""
    n, c, h, w = x.shape
    sigma = sigma.double().clamp(min=1e-3)
    radius = max(1, math.ceil(3 * float(sigma.max())))
    offsets = torch.arange(-radius, radius + 1, dtype=torch.float64)
    kernel = torch.exp(-(offsets**2) / (2 * sigma[:, None] ** 2))
    kernel[offsets.abs() > (3 * sigma[:, None]).ceil()] = 0.0  # each image's own 3-sigma support, whatever the batch
    kernel = (kernel / kernel.sum(1, keepdim=True)).to(device=x.device, dtype=x.dtype).repeat_interleave(c, 0)
    planes = F.pad(x.reshape(1, n * c, h, w), (radius,) * 4, mode="replicate")
    planes = F.conv2d(planes, kernel.view(n * c, 1, 1, -1), groups=n * c)
    planes = F.conv2d(planes, kernel.view(n * c, 1, -1, 1), groups=n * c)
    return planes.view(n, c, h, w)


# ---------------------------------------------------------------------------------------------- geometric ops


def warp(x: torch.Tensor, matrix: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """x resampled bilinearly at `matrix` @ (column, row, 1) for each output pixel: (n, 2, 3) per image, from output
    to input pixel indices. Samples outside the image blend towards `fill`; the identity returns x exactly."""
    n, c, h, w = x.shape
    m = matrix.to(device=x.device, dtype=torch.float32)
    cols = torch.arange(w, device=x.device, dtype=torch.float32).view(1, 1, w)
    rows = torch.arange(h, device=x.device, dtype=torch.float32).view(1, h, 1)
    src_x = m[:, 0, 0, None, None] * cols + m[:, 0, 1, None, None] * rows + m[:, 0, 2, None, None]
    src_y = m[:, 1, 0, None, None] * cols + m[:, 1, 1, None, None] * rows + m[:, 1, 2, None, None]
    x0, y0 = src_x.floor(), src_y.floor()
    fx, fy = (src_x - x0).to(x.dtype), (src_y - y0).to(x.dtype)
    # One pixel of fill around the image: a neighbour outside it is clamped onto that frame.
    framed = fill.to(device=x.device, dtype=x.dtype).view(1, c, 1, 1).expand(n, c, h + 2, w + 2).clone()
    framed[:, :, 1:-1, 1:-1] = x
    flat = framed.view(n, c, -1)

    def at(ys: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        index = (ys.clamp(-1, h).long() + 1) * (w + 2) + xs.clamp(-1, w).long() + 1
        return flat.gather(2, index.view(n, 1, -1).expand(n, c, -1)).view(n, c, h, w)

    fx, fy = fx[:, None], fy[:, None]
    top = at(y0, x0) * (1 - fx) + at(y0, x0 + 1) * fx
    bottom = at(y0 + 1, x0) * (1 - fx) + at(y0 + 1, x0 + 1) * fx
    return top * (1 - fy) + bottom * fy


def _affine(n: int, **entries: torch.Tensor) -> torch.Tensor:
    """(n, 2, 3) identity matrices with the given entries (a..f: row-major) replaced per image."""
    matrix = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], dtype=torch.float64).repeat(n, 1, 1)
    for name, value in entries.items():
        index = "abcdef".index(name)
        matrix[:, index // 3, index % 3] = value.double()
    return matrix


def rotate(x: torch.Tensor, degrees: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """Counter-clockwise by `degrees` about the image centre (PIL's Image.rotate)."""
    h, w = x.shape[-2:]
    cx, cy = (w - 1) / 2, (h - 1) / 2
    cos, sin = torch.cos(torch.deg2rad(degrees.double())), torch.sin(torch.deg2rad(degrees.double()))
    # Input = R(angle) (output - centre) + centre, with y pointing down: a counter-clockwise turn on screen.
    matrix = _affine(len(degrees), a=cos, b=-sin, c=cx - cos * cx + sin * cy, d=sin, e=cos, f=cy - sin * cx - cos * cy)
    return warp(x, matrix, fill)


def shear_x(x: torch.Tensor, shear: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """Row r moved left by shear * (r + 0.5) pixels: PIL's affine transform in timm, about the top-left corner, whose
    pixel centres sit at half-integers."""
    return warp(x, _affine(len(shear), b=shear, c=shear / 2), fill)


def shear_y(x: torch.Tensor, shear: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    return warp(x, _affine(len(shear), d=shear, f=shear / 2), fill)


def translate_x(x: torch.Tensor, fraction: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """Moved by `fraction` of the width (positive: left, as timm's TranslateXRel)."""
    return warp(x, _affine(len(fraction), c=fraction * x.shape[-1]), fill)


def translate_y(x: torch.Tensor, fraction: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    return warp(x, _affine(len(fraction), f=fraction * x.shape[-2]), fill)


# ---------------------------------------------------------------------------------------------- policies


@dataclass
class Layer:
    """One round of a policy: image i takes ops[choice[i]] (choice -1: none) with argument args[i]."""

    ops: tuple[OpFn, ...]
    choice: torch.Tensor  # (B,) int64 on the CPU
    args: torch.Tensor  # (B,) float64 on the CPU

    def apply(self, x: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
        """Each op once, on the images that drew it, written back in place of theirs (a new tensor)."""
        for k, op in enumerate(self.ops):
            rows = (self.choice == k).nonzero().flatten()
            if not len(rows):
                continue
            if len(rows) == len(self.choice):
                x = op(x, self.args, fill)
                continue
            on_device = rows.to(x.device, non_blocking=True)
            x = x.index_copy(0, on_device, op(x.index_select(0, on_device), self.args[rows], fill))
        return x


def _signs(b: int, generator: torch.Generator | None) -> torch.Tensor:
    return torch.where(torch.rand(b, generator=generator, dtype=torch.float64) < 0.5, -1.0, 1.0)


# level in [0, 1] (the magnitude over its maximum) and a random sign -> the op's argument, per image.
LevelFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _signed(scale: float) -> LevelFn:
    return lambda level, sign: level * scale * sign


def _enhance(level: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    return level * 1.8 + 0.1  # timm's Color, Contrast, ...: 0.1 at magnitude 0, 1.9 at 10


def _enhance_increasing(level: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    return (1.0 + level * 0.9 * sign).clamp(min=0.1)  # 1 (unchanged) at magnitude 0, 0.1 or 1.9 at 10


def _none(level: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(level)


# timm's RandAugment ops (`_RAND_TRANSFORMS`, and `_RAND_INCREASING_TRANSFORMS` for inc1), by timm's names, with
# timm's magnitude -> argument maps. Magnitude 0 leaves an image unchanged for every op that has a magnitude but
# PosterizeIncreasing (4 bits kept at 0, 0 at 10, as in timm) and the non-increasing Posterize, Solarize and enhance
# ops (strongest at 0); AutoContrast, Equalize and Invert have none.
RAND_OPS: dict[str, tuple[OpFn, LevelFn]] = {
    "AutoContrast": (auto_contrast, _none),
    "Equalize": (equalize, _none),
    "Invert": (invert, _none),
    "Rotate": (rotate, _signed(30.0)),
    "Posterize": (posterize, lambda level, sign: (level * 4).floor()),
    "PosterizeIncreasing": (posterize, lambda level, sign: 4 - (level * 4).floor()),
    "Solarize": (solarize, lambda level, sign: (level * 256).floor().clamp(max=256)),
    "SolarizeIncreasing": (solarize, lambda level, sign: 256 - (level * 256).floor().clamp(max=256)),
    "SolarizeAdd": (solarize_add, lambda level, sign: (level * 110).floor().clamp(max=128)),
    "Color": (color, _enhance),
    "ColorIncreasing": (color, _enhance_increasing),
    "Contrast": (contrast, _enhance),
    "ContrastIncreasing": (contrast, _enhance_increasing),
    "Brightness": (brightness, _enhance),
    "BrightnessIncreasing": (brightness, _enhance_increasing),
    "Sharpness": (sharpness, _enhance),
    "SharpnessIncreasing": (sharpness, _enhance_increasing),
    "ShearX": (shear_x, _signed(0.3)),
    "ShearY": (shear_y, _signed(0.3)),
    "TranslateXRel": (translate_x, _signed(0.45)),
    "TranslateYRel": (translate_y, _signed(0.45)),
}
_SHARED = ("AutoContrast", "Equalize", "Invert", "Rotate")
_GEOMETRIC = ("ShearX", "ShearY", "TranslateXRel", "TranslateYRel")
RAND_TRANSFORMS = (*_SHARED, "Posterize", "Solarize", "SolarizeAdd", "Color", "Contrast", "Brightness",
                   "Sharpness", *_GEOMETRIC)  # fmt: skip
RAND_INCREASING_TRANSFORMS = tuple(name if name in _SHARED + _GEOMETRIC + ("SolarizeAdd",) else f"{name}Increasing"
                                   for name in RAND_TRANSFORMS)  # fmt: skip
MAX_MAGNITUDE = 10.0  # timm's _LEVEL_DENOM: magnitudes run 0..10


@dataclass(frozen=True)
class RandAugmentSpec:
    """A timm RandAugment string, read: `rand-m9-mstd0.5-inc1` is magnitude 9, noise 0.5, increasing ops."""

    magnitude: float = MAX_MAGNITUDE  # m
    num_ops: int = 2  # n: ops per image
    prob: float = 0.5  # p: the chance each of them is applied
    magnitude_std: float = 0.0  # mstd: per-image noise on the magnitude; above 100, uniform in [0, m]
    increasing: bool = False  # inc1: the ops whose strength grows with the magnitude

    @staticmethod
    def parse(text: str, key: str = "data.randaugment") -> RandAugmentSpec:
        """The spec `text` names, or a ConfigError naming the section at fault and the fix."""
        head, *sections = text.split("-")
        if head != "rand":
            raise ConfigError(
                f"{key}={text}: only timm's RandAugment strings rand-... are read (e.g. rand-m9-mstd0.5-inc1); for "
                "TrivialAugment or 3-Augment set data.trivialaugment=true or data.three_augment=true"
            )
        values: dict[str, float] = {}
        for section in sections:
            match = re.fullmatch(r"([a-z]+)(\d[\d.]*)", section)
            name = match.group(1) if match else section
            if name in ("mmax", "t") or (match is None and section.startswith("t")):
                raise ConfigError(f"{key}={text}: section {section} (timm's {name}) is not supported; remove it")
            if match is None or name not in ("m", "n", "p", "mstd", "inc"):
                raise ConfigError(
                    f"{key}={text}: unknown section {section}; use m (magnitude 0-10), n (ops per image), p (the "
                    "chance of each op), mstd (magnitude noise) and inc (0 or 1), e.g. rand-m9-mstd0.5-inc1"
                )
            try:
                values[name] = float(match.group(2))
            except ValueError:
                raise ConfigError(f"{key}={text}: section {section} needs a number after {name}") from None
        spec = RandAugmentSpec(
            values.get("m", MAX_MAGNITUDE), int(values.get("n", 2)), values.get("p", 0.5), values.get("mstd", 0.0),
            bool(values.get("inc", 0)),
        )  # fmt: skip
        if not 0 <= spec.magnitude <= MAX_MAGNITUDE:
            raise ConfigError(f"{key}={text}: magnitude m={spec.magnitude:g} is out of range; use 0 to 10 (timm's)")
        if values.get("n", 2) != spec.num_ops or spec.num_ops < 1:
            raise ConfigError(f"{key}={text}: n={values['n']:g} ops per image must be a whole number >= 1")
        if not 0 <= spec.prob <= 1:
            raise ConfigError(f"{key}={text}: p={spec.prob:g} is a probability; use 0 to 1")
        if values.get("inc", 0) not in (0, 1):
            raise ConfigError(f"{key}={text}: inc={values['inc']:g} must be inc0 or inc1")
        return spec


class RandAugment:
    """timm's RandAugment: each image takes num_ops ops, each drawn uniformly (with replacement) from the list and
    applied with probability p, at its own magnitude (m plus N(0, mstd) noise, clipped to 0..10) and sign."""

    def __init__(self, spec: RandAugmentSpec, names: tuple[str, ...] | None = None):
        self.spec = spec
        self.names = names or (RAND_INCREASING_TRANSFORMS if spec.increasing else RAND_TRANSFORMS)
        self.ops = tuple(RAND_OPS[name][0] for name in self.names)
        self.levels = tuple(RAND_OPS[name][1] for name in self.names)

    def draw(self, b: int, generator: torch.Generator | None) -> list[Layer]:
        s, layers = self.spec, []
        for _ in range(s.num_ops):
            choice = torch.randint(len(self.ops), (b,), generator=generator)
            applied = torch.rand(b, generator=generator, dtype=torch.float64) < s.prob
            sign = _signs(b, generator)
            if s.magnitude_std > 100:  # timm: uniform in [0, m]
                magnitude = torch.rand(b, generator=generator, dtype=torch.float64) * s.magnitude
            else:
                magnitude = s.magnitude + s.magnitude_std * torch.randn(b, generator=generator, dtype=torch.float64)
            level = magnitude.clamp(0, MAX_MAGNITUDE) / MAX_MAGNITUDE
            args = torch.zeros(b, dtype=torch.float64)
            for k, to_arg in enumerate(self.levels):
                mask = choice == k
                args[mask] = to_arg(level[mask], sign[mask])
            layers.append(Layer(self.ops, torch.where(applied, choice, -1), args))
        return layers


# torchvision's TrivialAugmentWide: (op, argument at the strongest of the 31 strength bins); signed ops take a random
# sign. Translation is relative here (32 px at 224 px), and the solarize threshold runs 256 -> 0 (not 255 -> 0),
# so that bin 0 leaves every image unchanged.
TRIVIAL_OPS: dict[str, tuple[OpFn, LevelFn]] = {
    "Identity": (identity, _none),
    "ShearX": (shear_x, _signed(0.99)),
    "ShearY": (shear_y, _signed(0.99)),
    "TranslateX": (translate_x, _signed(32 / 224)),
    "TranslateY": (translate_y, _signed(32 / 224)),
    "Rotate": (rotate, _signed(135.0)),
    "Brightness": (brightness, lambda level, sign: 1 + level * 0.99 * sign),
    "Color": (color, lambda level, sign: 1 + level * 0.99 * sign),
    "Contrast": (contrast, lambda level, sign: 1 + level * 0.99 * sign),
    "Sharpness": (sharpness, lambda level, sign: 1 + level * 0.99 * sign),
    "Posterize": (posterize, lambda level, sign: 8 - (level * 6).round()),
    "Solarize": (solarize, lambda level, sign: 256 * (1 - level)),
    "AutoContrast": (auto_contrast, _none),
    "Equalize": (equalize, _none),
}
TRIVIAL_BINS = 31


class TrivialAugment:
    """TrivialAugment (Müller and Hutter, 2021; torchvision's wide ranges): one op per image, uniformly from the list,
    at a strength drawn uniformly from 31 bins."""

    def __init__(self, names: tuple[str, ...] | None = None):
        self.names = names or tuple(TRIVIAL_OPS)
        self.ops = tuple(TRIVIAL_OPS[name][0] for name in self.names)
        self.levels = tuple(TRIVIAL_OPS[name][1] for name in self.names)

    def draw(self, b: int, generator: torch.Generator | None) -> list[Layer]:
        choice = torch.randint(len(self.ops), (b,), generator=generator)
        level = torch.randint(TRIVIAL_BINS, (b,), generator=generator).double() / (TRIVIAL_BINS - 1)
        sign = _signs(b, generator)
        args = torch.zeros(b, dtype=torch.float64)
        for k, to_arg in enumerate(self.levels):
            mask = choice == k
            args[mask] = to_arg(level[mask], sign[mask])
        return [Layer(self.ops, choice, args)]


BLUR_SIGMA = (0.1, 2.0)  # DeiT III's GaussianBlur radius range
SOLARIZE_THRESHOLD = 128.0  # PIL's ImageOps.solarize default, as DeiT III calls it
THREE_AUGMENT_OPS: dict[str, OpFn] = {"Grayscale": grayscale, "Solarize": solarize, "GaussianBlur": gaussian_blur}


class ThreeAugment:
    """DeiT III's 3-Augment: one of grayscale, solarize (threshold 128) or Gaussian blur (sigma ~ U(0.1, 2)) per
    image, uniformly; the colour jitter that follows it is ColorJitter's (data.color_jitter)."""

    def __init__(self, names: tuple[str, ...] | None = None):
        self.names = names or tuple(THREE_AUGMENT_OPS)
        self.ops = tuple(THREE_AUGMENT_OPS[name] for name in self.names)

    def draw(self, b: int, generator: torch.Generator | None) -> list[Layer]:
        choice = torch.randint(len(self.ops), (b,), generator=generator)
        sigma = torch.empty(b, dtype=torch.float64).uniform_(*BLUR_SIGMA, generator=generator)
        each = {"Grayscale": torch.ones_like(sigma), "Solarize": torch.full_like(sigma, SOLARIZE_THRESHOLD)}
        args = torch.stack([each.get(name, sigma) for name in self.names])
        return [Layer(self.ops, choice, args.gather(0, choice[None]).squeeze(0))]


class ColorJitter:
    """torchvision's ColorJitter(j, j, j) without hue: brightness, contrast and saturation, each by a factor from
    U(max(0, 1 - j), 1 + j), in an order drawn per image."""

    names = ("Brightness", "Contrast", "Color")
    ops: tuple[OpFn, ...] = (brightness, contrast, color)

    def __init__(self, strength: float):
        self.strength = strength

    def draw(self, b: int, generator: torch.Generator | None) -> list[Layer]:
        order = torch.rand(b, 3, generator=generator).argsort(1)
        factors = torch.empty(b, 3, dtype=torch.float64)
        factors.uniform_(max(0.0, 1 - self.strength), 1 + self.strength, generator=generator)
        return [Layer(self.ops, order[:, slot], factors.gather(1, order[:, slot : slot + 1]).squeeze(1))
                for slot in range(3)]  # fmt: skip


class StrongAugment:
    """The configured policies in turn (RandAugment, TrivialAugment or 3-Augment, then colour jitter) on a float
    batch of 0-255 pixels; geometric ops fill what they uncover with `fill` (the normalization mean, in pixels)."""

    def __init__(self, policies: list, fill: torch.Tensor):
        self.policies = policies
        self.fill = fill

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        for policy in self.policies:
            for layer in policy.draw(x.shape[0], generator):
                x = layer.apply(x, self.fill)
        return x


DEIT3_COLOR_JITTER = 0.3  # data.color_jitter's value under data.three_augment when left unset


def strong_augment(cfg: DataConfig, fill: torch.Tensor) -> StrongAugment | None:
    """data.randaugment / trivialaugment / three_augment / color_jitter as one StrongAugment (None: all off)."""
    policies: list = []
    if cfg.randaugment:
        policies.append(RandAugment(RandAugmentSpec.parse(cfg.randaugment)))
    if cfg.trivialaugment:
        policies.append(TrivialAugment())
    if cfg.three_augment:
        policies.append(ThreeAugment())
    jitter = cfg.color_jitter if cfg.color_jitter is not None else DEIT3_COLOR_JITTER * cfg.three_augment
    if jitter:
        policies.append(ColorJitter(jitter))
    return StrongAugment(policies, fill) if policies else None


# ---------------------------------------------------------------------------------------------- random erasing

ERASE_AREA = (0.02, 1 / 3)  # timm's RandomErasing defaults: area fraction of the box
ERASE_ASPECT = (0.3, 1 / 0.3)  # and its aspect ratio


class RandomErasing:
    """timm's RandomErasing in "pixel" mode (DeiT's): with probability `prob` an image gets one box filled with
    per-pixel noise, N(0, 1) after normalization; here before it, as mean + std * N(0, 1) in pixels (the same)."""

    def __init__(self, prob: float, mean: torch.Tensor, std: torch.Tensor, attempts: int = 10):
        self.prob, self.mean, self.std, self.attempts = prob, mean, std, attempts

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        b, c, h, w = x.shape
        area = h * w * torch.empty(b, self.attempts, dtype=torch.float64).uniform_(*ERASE_AREA, generator=generator)
        log_aspect = torch.empty(b, self.attempts, dtype=torch.float64)
        aspect = log_aspect.uniform_(*map(math.log, ERASE_ASPECT), generator=generator).exp()
        box_h, box_w = (area * aspect).sqrt().round(), (area / aspect).sqrt().round()
        fits = (box_h < h) & (box_w < w) & (box_h > 0) & (box_w > 0)
        first = fits.double().argmax(1, keepdim=True)  # the first attempt that fits, as timm tries them
        box_h, box_w = box_h.gather(1, first).squeeze(1), box_w.gather(1, first).squeeze(1)
        top = (torch.rand(b, generator=generator, dtype=torch.float64) * (h - box_h + 1)).floor()
        left = (torch.rand(b, generator=generator, dtype=torch.float64) * (w - box_w + 1)).floor()
        erased = (torch.rand(b, generator=generator) < self.prob) & fits.any(1)
        seed = int(torch.randint(2**62, (1,), generator=generator))
        rows = erased.nonzero().flatten()
        if not len(rows):
            return x
        # The noise is drawn on the device, from a generator seeded by the batch's.
        noise_gen = torch.Generator(device=x.device).manual_seed(seed)
        noise = torch.randn((len(rows), c, h, w), generator=noise_gen, device=x.device, dtype=x.dtype)
        fill = self.mean.to(x.device, x.dtype) + self.std.to(x.device, x.dtype) * noise
        inside = _span(top[rows], box_h[rows], h)[:, :, None] & _span(left[rows], box_w[rows], w)[:, None, :]
        on_device = rows.to(x.device, non_blocking=True)
        boxes = torch.where(inside.to(x.device)[:, None], fill, x.index_select(0, on_device))
        return x.index_copy(0, on_device, boxes)


def _span(start: torch.Tensor, size: torch.Tensor, extent: int) -> torch.Tensor:
    """(k, extent) masks of [start, start + size) per row."""
    positions = torch.arange(extent, dtype=start.dtype)
    return (positions >= start[:, None]) & (positions < (start + size)[:, None])
