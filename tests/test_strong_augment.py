"""Strong augmentation (vitrain/data/strong.py): each op's shape, dtype, seeding and magnitude 0, its values against
PIL (what timm and DeiT run), per-image ops in one batch, random erasing, the config's refusals, and training runs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.distributed_helpers import losses, whole_and_resumed
from tests.test_checkpoint import TEN_STEPS
from tests.test_mistakes import error_line
from vitrain.cli import main
from vitrain.config import load_config
from vitrain.data import BatchAugment
from vitrain.data import strong as S
from vitrain.errors import ConfigError

PIL = pytest.importorskip("PIL.Image", reason="Pillow is the reference the ops are compared with")
FILL = torch.full((3,), 128.0)


def _images(n: int = 6, h: int = 20, w: int = 24, seed: int = 0) -> torch.Tensor:
    """Float RGB images of 0-255 levels (whole numbers, as decoded data has)."""
    return torch.randint(0, 256, (n, 3, h, w), generator=torch.Generator().manual_seed(seed)).float()


def _run(policy, x: torch.Tensor, seed: int) -> torch.Tensor:
    return S.StrongAugment([policy], FILL)(x, torch.Generator().manual_seed(seed))


def _rand(spec: str, name: str) -> S.RandAugment:
    return S.RandAugment(S.RandAugmentSpec.parse(spec), names=(name,))


# ---------------------------------------------------------------------------------------------- each op alone

# Every RandAugment op of timm's two lists, each as a policy that always applies it (n1, p1).
RAND_NAMES = sorted(S.RAND_OPS)
# timm's ops that do not leave an image unchanged at magnitude 0: those without a magnitude, PosterizeIncreasing (4
# bits kept at 0) and the non-increasing ones (strongest at 0). The test after the next checks what they do there.
NOT_NEUTRAL_AT_0 = ("AutoContrast", "Equalize", "Invert", "PosterizeIncreasing", "Posterize", "Solarize", "Color",
                    "Contrast", "Brightness", "Sharpness")  # fmt: skip


@pytest.mark.parametrize("name", RAND_NAMES)
def test_each_randaugment_op_keeps_shape_and_dtype_and_follows_the_seed(name):
    x = _images(n=8)
    policy = _rand("rand-n1-p1-m5-mstd3", name)  # magnitudes spread widely: even posterize's bits differ
    out = _run(policy, x, seed=1)
    assert out.shape == x.shape and out.dtype == torch.float32
    assert 0.0 <= float(out.min()) and float(out.max()) <= 255.0
    assert torch.equal(out, _run(policy, x, seed=1))
    if name not in ("AutoContrast", "Equalize", "Invert"):  # a magnitude (and sign) drawn per image: seeds differ
        assert not torch.equal(out, _run(policy, x, seed=2))


@pytest.mark.parametrize("name", [name for name in RAND_NAMES if name not in NOT_NEUTRAL_AT_0])
def test_randaugment_ops_with_a_magnitude_are_the_identity_at_magnitude_0(name):
    x = _images()
    assert torch.equal(_run(_rand("rand-n1-p1-m0", name), x, seed=3), x)


def test_the_ops_without_a_neutral_magnitude_0_do_what_timm_does_there():
    x = _images()
    at_0 = lambda name: _run(_rand("rand-n1-p1-m0", name), x, seed=0)  # noqa: E731
    assert torch.equal(at_0("PosterizeIncreasing") % 16, torch.zeros_like(x))  # 4 bits kept
    assert torch.equal(at_0("Posterize"), torch.zeros_like(x))  # 0 bits kept
    assert torch.equal(at_0("Solarize"), 255 - x)  # threshold 0: all inverted
    assert torch.equal(at_0("Brightness"), (x * 0.1).clamp(0, 255))  # factor 0.1
    assert torch.equal(at_0("Invert"), 255 - x)
    assert torch.equal(S.posterize(x, torch.full((6,), 8.0), FILL), x)  # 8 bits: the posterize identity


@pytest.mark.parametrize("name", list(S.THREE_AUGMENT_OPS))
def test_each_three_augment_op_keeps_shape_and_dtype_and_follows_the_seed(name):
    x = _images()
    policy = S.ThreeAugment(names=(name,))
    out = _run(policy, x, seed=1)
    assert out.shape == x.shape and out.dtype == torch.float32
    assert torch.equal(out, _run(policy, x, seed=1))
    if name == "GaussianBlur":  # the only one with a random strength (sigma)
        assert not torch.equal(out, _run(policy, x, seed=2))
    assert not torch.equal(out, x)


@pytest.mark.parametrize(("name", "neutral"), [("Grayscale", 0.0), ("Solarize", 256.0), ("GaussianBlur", 0.0)])
def test_three_augment_ops_are_the_identity_at_magnitude_0(name, neutral):
    x = _images()
    assert torch.equal(S.THREE_AUGMENT_OPS[name](x, torch.full((6,), neutral, dtype=torch.float64), FILL), x)


def test_color_jitter_follows_the_seed_and_is_the_identity_at_strength_0():
    x = _images()
    out = _run(S.ColorJitter(0.3), x, seed=1)
    assert out.shape == x.shape and out.dtype == torch.float32
    assert torch.equal(out, _run(S.ColorJitter(0.3), x, seed=1))
    assert not torch.equal(out, _run(S.ColorJitter(0.3), x, seed=2))
    assert torch.equal(_run(S.ColorJitter(0.0), x, seed=1), x)


def test_trivialaugment_follows_the_seed_and_bin_0_of_every_op_is_the_identity():
    x = _images(n=32)
    out = _run(S.TrivialAugment(), x, seed=1)
    assert out.shape == x.shape and torch.equal(out, _run(S.TrivialAugment(), x, seed=1))
    no_magnitude = ("AutoContrast", "Equalize")
    for name, (op, to_arg) in S.TRIVIAL_OPS.items():
        if name not in no_magnitude:
            arg = to_arg(torch.zeros(32, dtype=torch.float64), torch.ones(32, dtype=torch.float64))
            assert torch.equal(op(x, arg, FILL), x), name


# ---------------------------------------------------------------------------------------------- against PIL


def _pil(x: torch.Tensor):
    return PIL.fromarray(x[0].permute(1, 2, 0).to(torch.uint8).numpy())


def _from_pil(image) -> torch.Tensor:
    return torch.from_numpy(np.array(image)).permute(2, 0, 1)[None].float()


def _one(value: float) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float64)


@pytest.mark.parametrize(
    ("op", "arg", "reference"),
    [
        (S.auto_contrast, 0, lambda im, ops, enh: ops.autocontrast(im)),
        (S.equalize, 0, lambda im, ops, enh: ops.equalize(im)),
        (S.invert, 0, lambda im, ops, enh: ops.invert(im)),
        (S.posterize, 3, lambda im, ops, enh: ops.posterize(im, 3)),
        (S.solarize, 100, lambda im, ops, enh: ops.solarize(im, 100)),
        (S.brightness, 1.5, lambda im, ops, enh: enh.Brightness(im).enhance(1.5)),
        (S.color, 0.3, lambda im, ops, enh: enh.Color(im).enhance(0.3)),
        (S.contrast, 1.7, lambda im, ops, enh: enh.Contrast(im).enhance(1.7)),
        (S.sharpness, 1.9, lambda im, ops, enh: enh.Sharpness(im).enhance(1.9)),
    ],
)
def test_colour_ops_match_pil_within_rounding(op, arg, reference):
    from PIL import ImageEnhance, ImageOps

    x = torch.randint(30, 220, (1, 3, 20, 24), generator=torch.Generator().manual_seed(0)).float()
    expected = _from_pil(reference(_pil(x), ImageOps, ImageEnhance))
    torch.testing.assert_close(op(x, _one(arg), FILL), expected, atol=2.0, rtol=0)  # PIL rounds every level


def test_geometric_ops_match_pils_transforms_away_from_the_border():
    x = torch.randint(0, 256, (1, 3, 20, 24), generator=torch.Generator().manual_seed(0)).float()
    image, grey = _pil(x), (128, 128, 128)
    affine = lambda *m: _from_pil(image.transform(image.size, PIL.AFFINE, m, PIL.BILINEAR, fillcolor=grey))  # noqa: E731
    shear_x, shear_y = S.shear_x(x, _one(0.3), FILL), S.shear_y(x, _one(0.3), FILL)
    torch.testing.assert_close(
        shear_x[..., :-7], affine(1, 0.3, 0, 0, 1, 0)[..., :-7], atol=1.5, rtol=0
    )  # PIL rounds to whole levels
    torch.testing.assert_close(
        shear_y[..., :-8, :], affine(1, 0, 0, 0.3, 1, 0)[..., :-8, :], atol=1.5, rtol=0
    )  # PIL rounds to whole levels
    torch.testing.assert_close(S.translate_x(x, _one(0.25), FILL), affine(1, 0, 6, 0, 1, 0), atol=0, rtol=0)
    rotated = _from_pil(image.rotate(30, PIL.BILINEAR, fillcolor=grey))
    rows, cols = torch.meshgrid(torch.arange(20.0) - 9.5, torch.arange(24.0) - 11.5, indexing="ij")
    inside = rows**2 + cols**2 < 8.0**2  # pixels whose source lies well inside the image
    torch.testing.assert_close(
        S.rotate(x, _one(30), FILL)[..., inside], rotated[..., inside], atol=1.5, rtol=0
    )  # PIL rounds to whole levels


def test_a_quarter_turn_is_torchs_rot90_counter_clockwise():
    x = _images(n=2, h=16, w=16)
    out = S.rotate(x, torch.tensor([90.0, -90.0], dtype=torch.float64), FILL)
    expected = torch.stack([x[0].rot90(1, (1, 2)), x[1].rot90(-1, (1, 2))])
    torch.testing.assert_close(out, expected, atol=1e-3, rtol=0)


def test_grayscale_puts_the_luminance_in_every_channel():
    x = _images(n=2)
    out = S.grayscale(x, torch.ones(2, dtype=torch.float64), FILL)
    expected = (0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]).unsqueeze(1).expand_as(x)
    torch.testing.assert_close(out, expected)


def test_blur_keeps_a_flat_image_and_smooths_noise():
    flat = torch.full((2, 3, 16, 16), 77.0)
    sigma = torch.tensor([0.5, 2.0], dtype=torch.float64)
    torch.testing.assert_close(S.gaussian_blur(flat, sigma, FILL), flat)
    noisy = _images(n=2, h=16, w=16)
    spread = S.gaussian_blur(noisy, sigma, FILL).std((1, 2, 3))
    assert spread[1] < spread[0] < noisy.std((1, 2, 3)).min()


# ---------------------------------------------------------------------------------------------- whole batches


def test_every_image_of_a_batch_draws_its_own_ops_and_strengths():
    x = _images(n=1).expand(32, -1, -1, -1)  # 32 copies of one image
    out = _run(S.RandAugment(S.RandAugmentSpec.parse("rand-m9-mstd0.5-inc1")), x, seed=0)
    assert len({tuple(o.flatten()[:64].tolist()) for o in out}) > 16


@pytest.mark.parametrize("policy", ["rand", "trivial", "three", "jitter"])
def test_a_batch_gets_what_each_of_its_images_gets_alone(policy):
    policy = {
        "rand": S.RandAugment(S.RandAugmentSpec.parse("rand-n3-p0.8-m9-mstd0.5-inc1")),
        "trivial": S.TrivialAugment(),
        "three": S.ThreeAugment(),
        "jitter": S.ColorJitter(0.4),
    }[policy]
    x = _images(n=24)
    layers = policy.draw(24, torch.Generator().manual_seed(5))
    batch = x
    for layer in layers:
        batch = layer.apply(batch, FILL)
    for i in range(24):
        alone = x[i : i + 1]
        for layer in layers:
            alone = S.Layer(layer.ops, layer.choice[i : i + 1], layer.args[i : i + 1]).apply(alone, FILL)
        torch.testing.assert_close(batch[i : i + 1], alone, atol=1e-3, rtol=0)


def test_random_erasing_fills_one_box_per_image_with_unit_noise_after_normalization():
    x = torch.zeros(200, 3, 16, 16)
    mean, std = torch.full((1, 3, 1, 1), 100.0), torch.full((1, 3, 1, 1), 50.0)
    erasing = S.RandomErasing(1.0, mean, std)
    out = erasing(x, torch.Generator().manual_seed(0))
    assert torch.equal(out, erasing(x, torch.Generator().manual_seed(0)))
    changed = (out != 0).any(1)  # (B, H, W)
    rows, cols = changed.any(2), changed.any(1)
    areas = changed.sum((1, 2)).float()
    assert torch.equal(areas, rows.sum(1) * cols.sum(1).float())  # a box: its rows x its columns
    assert changed.any((1, 2)).float().mean() > 0.95  # every image, but a rare one where no try fits
    assert 2 <= areas[areas > 0].min() and areas.max() <= 100  # 2-33% of 256 pixels, give or take rounding
    noise = (out[changed.unsqueeze(1).expand_as(out)] - 100.0) / 50.0
    assert abs(float(noise.mean())) < 0.05 and abs(float(noise.std()) - 1.0) < 0.05


def test_random_erasing_erases_about_its_probability_of_images():
    x = torch.zeros(1000, 1, 8, 8)
    out = S.RandomErasing(0.25, torch.zeros(1, 1, 1, 1), torch.ones(1, 1, 1, 1))(x, torch.Generator().manual_seed(1))
    assert 0.19 < float((out != 0).any((1, 2, 3)).float().mean()) < 0.31


def test_batch_augment_applies_the_switches_in_training_only(tiny_cfg):
    d = tiny_cfg.data
    d.randaugment, d.random_erasing = "rand-m9-mstd0.5-inc1", 0.5
    images, labels = torch.randint(0, 256, (8, 1, 16, 16), dtype=torch.uint8), torch.arange(8)
    train = BatchAugment(d, channels=1, train=True, image_size=16, num_classes=10)
    a, _ = train(images, labels, torch.Generator().manual_seed(3))
    assert torch.equal(a, train(images, labels, torch.Generator().manual_seed(3))[0])
    assert not torch.equal(a, (images.float() / 255 - 0.5) / 0.5)
    evaluated, _ = BatchAugment(d, channels=1, train=False, image_size=16, num_classes=10)(images, labels)
    torch.testing.assert_close(evaluated, (images.float() / 255 - 0.5) / 0.5)


# ---------------------------------------------------------------------------------------------- config


def test_timms_randaugment_string_is_read_with_timms_defaults():
    assert S.RandAugmentSpec.parse("rand-m9-mstd0.5-inc1") == S.RandAugmentSpec(9.0, 2, 0.5, 0.5, True)
    assert S.RandAugmentSpec.parse("rand") == S.RandAugmentSpec(10.0, 2, 0.5, 0.0, False)
    assert S.RandAugment(S.RandAugmentSpec.parse("rand-inc1")).names == S.RAND_INCREASING_TRANSFORMS


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.randaugment=augmix-m3"], r"only timm's RandAugment strings rand-\.\.\. are read"),
        (["data.randaugment=rand-m11-inc1"], r"magnitude m=11 is out of range; use 0 to 10"),
        (["data.randaugment=rand-m9-x2"], r"unknown section x2; use m \(magnitude 0-10\)"),
        (["data.randaugment=rand-n0"], r"n=0 ops per image must be a whole number >= 1"),
        (["data.randaugment=rand-p1.5"], r"p=1.5 is a probability"),
        (["data.randaugment=rand-inc2"], r"inc=2 must be inc0 or inc1"),
        (["data.randaugment=rand-m9-tweights"], r"section tweights .* is not supported"),
        (["data.randaugment=rand-m9", "data.three_augment=true"], r"data.randaugment and data.three_augment are on"),
        (["data.color_jitter=1.5"], r"data.color_jitter=1.5 must be in \[0, 1\]"),
        (["data.random_erasing=1.2"], r"data.random_erasing=1.2 is a probability"),
        (["data.repeated_aug=0"], r"data.repeated_aug=0 must be >= 1"),
        (["data.loader=plain", "data.source=folder", "data.root=x", "data.trivialaugment=true"],
         r"data.trivialaugment runs in the fast loader; .* set data.loader=fast"),
        (["data.loader=plain", "data.source=folder", "data.root=x", "data.repeated_aug=3"],
         r"data.repeated_aug runs in the fast loader"),
    ],
)  # fmt: skip
def test_bad_augmentation_settings_are_refused_naming_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_an_out_of_range_magnitude_exits_2_with_one_line(capsys):
    line = error_line(capsys, ["train", "digits", "data.randaugment=rand-m12"])
    assert line.startswith("data.randaugment=rand-m12: magnitude m=12 is out of range")


# ---------------------------------------------------------------------------------------------- training


@pytest.mark.parametrize(
    "switches",
    [
        ["data.randaugment=rand-m9-mstd0.5-inc1", "data.random_erasing=0.25", "data.repeated_aug=3"],
        ["data.trivialaugment=true"],
        ["data.three_augment=true", "data.hflip=0.5"],
    ],
    ids=["randaugment+erasing+repeats", "trivialaugment", "three_augment"],
)
def test_the_digits_recipe_trains_with_each_switch_from_the_cli(tmp_path, switches):
    out = tmp_path / "runs"
    argv = ["train", "digits", *switches, "train.max_steps=2", "log.progress=false", f"log.out_dir={out}", "name=r"]
    assert main(argv) == 0
    summary = json.loads((out / "r" / "summary.json").read_text())
    assert summary["steps"] == 2 and 0.0 <= summary["val_top1"] <= 1.0
    saved = load_config(out / "r" / "config.yaml")
    for switch in switches:
        key, value = switch.removeprefix("data.").split("=")
        assert str(getattr(saved.data, key)).lower() == value


def test_a_resume_mid_epoch_with_the_switches_on_continues_bit_for_bit(tmp_path):
    switches = {"randaugment": "rand-m9-mstd0.5-inc1", "random_erasing": 0.25, "repeated_aug": 3, "hflip": 0.5}
    # Stopped after step 5: mid-epoch (3 steps per epoch).
    whole, part, _ = whole_and_resumed(tmp_path, TEN_STEPS, stop_at=5, data=switches)
    expected, got = losses(whole.run_dir), losses(part.run_dir)
    assert [got[s] for s in range(6, 11)] == [expected[s] for s in range(6, 11)]  # exactly, not approximately
