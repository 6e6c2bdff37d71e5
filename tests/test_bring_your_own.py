"""Models, tasks and data of a user's own, named by import path: trained by vitrain's speed stack, nothing edited.

A plain module defined here and timm's ViT train under zero3 + amp_o2 on 2 gloo ranks and export to safetensors; a
task defined here trains from the command line; datasets handed to the library train without a data source.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any, Protocol

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from tests.conftest import run_cli
from tests.distributed_helpers import run_two_ranks, tiny_config
from vitrain.cli import main
from vitrain.config import Config
from vitrain.data import ImageSet, build_loaders
from vitrain.errors import ConfigError, DataError
from vitrain.models import build_model, plan_of
from vitrain.tasks.evaluate import evaluate


class UserBlock(nn.Module):
    """A pre-norm residual MLP block: the repeated unit vitrain finds, shards and keeps its norm in fp32."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class UserNet(nn.Module):
    def __init__(self, in_chans: int, num_classes: int, width: int = 32, depth: int = 3):
        super().__init__()
        self.stem = nn.Conv2d(in_chans, width, kernel_size=4, stride=4)
        self.layers = nn.ModuleList(UserBlock(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.classifier = nn.Linear(width, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images).flatten(2).transpose(1, 2)
        for layer in self.layers:
            x = layer(x)
        return self.classifier(self.norm(x).mean(dim=1))


def user_net(cfg) -> nn.Module:  # noqa: ANN001 (vitrain's ModelConfig)
    """`model.name=tests.test_bring_your_own:user_net`: a factory called with the model config."""
    return UserNet(cfg.in_chans, cfg.num_classes)


class ErrorRateTask:
    """A task of the user's own: classification scored by its error rate, the lower the better."""

    name = "error-rate"
    best_metric = "val_error"
    higher_is_better = False
    summary_defaults = {"val_error": 1.0}

    def __init__(self, cfg, model=None, data=None):  # noqa: ANN001
        self.cfg, self.model, self.data = cfg, model, data

    def build_data(self, device, rank, world_size):  # noqa: ANN001, ANN201
        train, self.val_loader = build_loaders(self.cfg, device, rank, world_size, self.data)
        return train

    def build_model(self) -> nn.Module:
        return build_model(self.cfg.model, model=self.model)

    def build_head(self, device):  # noqa: ANN001, ANN201
        return None

    def loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.float(), labels)

    def evaluate(self, forward, final, out_dir):  # noqa: ANN001, ANN201
        return {"val_error": 1.0 - evaluate(forward, self.val_loader)["val_top1"]}

    def eval_line(self, metrics) -> str:  # noqa: ANN001
        return f"val_error={metrics['val_error']:.4f}"

    def describe_data(self) -> str:
        return f"{len(self.val_loader.data)} val images, scored by error rate"


def _sharded_five_steps(out_dir: Path, model_name: str, image_size: int) -> None:
    from vitrain.engine import Trainer

    cfg = tiny_config(
        out_dir,
        "byo",
        batch_size=4,
        model={"name": model_name, "image_size": image_size, "num_classes": 4},
        parallel={"strategy": "zero3"},
        precision={"mode": "amp_o2", "dtype": "bf16"},
        train={"max_steps": 5, "epochs": 5},
        data={"synthetic_samples": 40},
    )
    trainer = Trainer(cfg)
    try:
        units = plan_of(trainer.model, "block").shard_units
        assert len(units) >= 3 and all(type(u) is type(units[0]) for u in units)  # its repeated block, found
        first_block = units[0]
        assert trainer.engine.precision_label == "amp_o2 bfloat16"
        summary = trainer.fit()
        # Norms stay fp32 units; the block around them computes in bf16 on fp32 shards.
        norm = next(m for m in first_block.modules() if isinstance(m, nn.LayerNorm))
        assert norm.weight.dtype == torch.float32
    finally:
        trainer.close()
    assert summary["steps"] == 5 and summary["world_size"] == 2 and summary["strategy"] == "zero3"


def _train_and_export(tmp_path: Path, model_name: str, image_size: int) -> dict[str, torch.Tensor]:
    run_two_ranks(_sharded_five_steps, tmp_path / "runs", model_name, image_size)
    run = tmp_path / "runs" / "byo"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records if "loss" in r)
    # A checkpoint's import path is imported only when the command line gives it too (vitrain/trust.py).
    assert main(["export", str(run), str(tmp_path / "out"), f"model.name={model_name}"]) == 0
    return load_file(str(tmp_path / "out" / "model.safetensors"))


def test_a_users_module_trains_under_zero3_and_amp_o2_on_two_ranks_and_exports(tmp_path):
    exported = _train_and_export(tmp_path, "tests.test_bring_your_own:user_net", image_size=8)
    fresh = UserNet(3, 4).state_dict()
    assert exported.keys() == fresh.keys()  # the user's own parameter names, in fp32
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in exported.values())
    assert not torch.equal(exported["classifier.weight"], fresh["classifier.weight"])
    assert "M params, no FLOP count for this model, device=" in (tmp_path / "runs" / "byo" / "log.txt").read_text()


@pytest.mark.slow  # the default suite keeps a user's own module under zero3 (above)
def test_timms_vit_small_trains_under_zero3_and_amp_o2_on_two_ranks_and_exports(tmp_path):
    if importlib.util.find_spec("timm") is None:
        pytest.skip("timm is not installed (pip install 'vitrain[peers]')")
    exported = _train_and_export(tmp_path, "timm:vit_small_patch16_224", image_size=32)
    assert exported["blocks.11.attn.qkv.weight"].shape == (3 * 384, 384)  # timm's names, ViT-S's shapes
    assert exported["head.weight"].shape == (4, 384)


def test_a_task_defined_outside_vitrain_trains_from_the_command_line(tmp_path):
    done = run_cli(
        "train",
        "digits",
        "task.name=tests.test_bring_your_own:ErrorRateTask",
        "train.max_steps=3",
        "train.epochs=1",
        "model.depth=2",
        "precision.mode=fp32",
        "log.progress=false",
        f"log.out_dir={tmp_path}",
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "digits" / "summary.json").read_text())
    assert summary["task"] == "error-rate" and summary["steps"] == 3
    assert 0.0 <= summary["val_error"] <= 1.0 and summary["best_val_error"] == summary["val_error"]
    assert "val_error=" in (tmp_path / "digits" / "log.txt").read_text()


def test_an_unknown_component_path_is_one_line_naming_the_key(tmp_path):
    done = run_cli("train", "digits", "task.name=tests.no_such_module:Task", f"log.out_dir={tmp_path}", warnings="")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "vitrain: error: task.name=tests.no_such_module:Task: cannot import tests.no_such_module "
        "(No module named 'tests.no_such_module'); check the name or install it"
    ]


class _HasWidth(Protocol):
    width: int


def _typed_init(annotation: Any) -> Any:
    def __init__(self, cfg) -> None:  # noqa: ANN001, N807
        FlatNet.__init__(self, cfg)

    __init__.__annotations__ = {"cfg": annotation, "return": None}
    return __init__


class ClassesNet(nn.Linear):
    def __init__(self, num_classes: int, width: int = 8):
        super().__init__(width, num_classes)


_A_MODULE_OR_A_FUNCTION = r"give a module \(model=Net\(\.\.\.\)\) or a function of the model config returning one"


@pytest.mark.parametrize(
    "model, line",
    [
        (
            "vit",
            rf"^model='vit' is a str, not a module; {_A_MODULE_OR_A_FUNCTION} .*set model\.name=vit in the config\)$",
        ),
        (3, rf"^model=3 is an int, not a module; {_A_MODULE_OR_A_FUNCTION}"),
        (
            UserNet,
            r"^model=UserNet is a class, not a module; pass an instance, model=UserNet\(\.\.\.\), or a function ",
        ),
        (
            lambda: UserNet(1, 10),
            rf"^model= is a function that cannot be called with the model config; {_A_MODULE_OR_A_FUNCTION}",
        ),
        (lambda cfg: None, r"^model= returned a NoneType, not a torch\.nn\.Module; fix the factory$"),
        (
            ClassesNet,  # one argument, but not the config: it would be built with the config as its classes
            rf"^model=ClassesNet is called with the model config, but its first parameter is num_classes: int; "
            rf"{_A_MODULE_OR_A_FUNCTION}",
        ),
    ],
)
def test_a_model_handed_in_that_is_not_a_module_or_a_function_of_the_config_is_one_line_naming_model(
    model, line, tiny_model_cfg
):
    with pytest.raises(ConfigError, match=line):
        build_model(tiny_model_cfg, model=model)
    assert isinstance(build_model(tiny_model_cfg, model=user_net), UserNet)  # a factory of the model config
    assert isinstance(build_model(tiny_model_cfg, model=FlatNet), FlatNet)  # a class built from the model config
    for annotation in (Any, _HasWidth):  # annotations that may stand for the model config are not refused
        built = build_model(tiny_model_cfg, model=lambda cfg, a=annotation: FlatNet(cfg))
        assert isinstance(built, FlatNet)
        typed = type("Typed", (FlatNet,), {"__init__": _typed_init(annotation)})
        assert isinstance(build_model(tiny_model_cfg, model=typed), FlatNet)
    assert isinstance(build_model(tiny_model_cfg, 8, model=lambda cfg, embed_dim: UserNet(1, embed_dim)), UserNet)


def test_build_model_takes_the_model_section_and_says_so_in_one_line():
    with pytest.raises(ConfigError, match=r"^build_model\(cfg\) takes a ModelConfig .*not the whole Config: pass "):
        build_model(Config())
    with pytest.raises(ConfigError, match=r"^build_model\(cfg\) takes a ModelConfig .*, not str$"):
        build_model("vit")


def test_datasets_handed_to_the_library_train_without_a_data_source(tmp_path):
    import vitrain

    draw = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (48, 1, 16, 16), dtype=torch.uint8, generator=draw)
    labels = torch.arange(48) % 4
    data = ImageSet(images, labels, ["a", "b", "c", "d"])
    summary = vitrain.train(
        "digits",
        [
            "train.max_steps=2",
            "train.batch_size=16",
            "model.num_classes=4",
            "model.depth=2",
            "log.progress=false",
            f"log.out_dir={tmp_path}",
            "precision.mode=fp32",
        ],  # fmt: skip
        model=user_net,
        data=(data.subset(torch.arange(32)), data.subset(torch.arange(32, 48))),
    )
    assert summary["steps"] == 2 and summary["params"] == sum(p.numel() for p in UserNet(1, 4).parameters())


# slow: 9 s on a Zen 4
@pytest.mark.slow
def test_a_module_handed_to_the_library_leaves_with_its_own_layer_classes(tmp_path):
    """Engines swap CPU linear layers (and a patch embedding's conv) to the CPU kernels' classes
    (vitrain/models/kernels.py) for training only."""
    import vitrain

    net = UserNet(1, 10)
    overrides = ["train.max_steps=1", "train.batch_size=16", f"log.out_dir={tmp_path}", "log.progress=false"]
    vitrain.train("digits", [*overrides, "precision.mode=amp_o2", "train.fused_linear=true"], model=net)
    linears = [m for m in net.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 7 and all(type(m) is nn.Linear for m in linears)
    # a set-up that fails after the engine swapped them (a flat model cannot recompute blocks) gives them back too
    flat = FlatNet(vitrain.load_config("digits", ["model.num_classes=10"]).model)
    with pytest.raises(ConfigError, match="recomputes repeated blocks"):
        vitrain.train("digits", [*overrides, "parallel.activation_checkpointing=block"], model=flat)
    assert type(flat.head) is nn.Linear and type(flat.conv) is nn.Conv2d


def test_sharded_init_refuses_a_model_handed_in_that_is_not_vitrains_vit_or_is_built_already(tmp_path):
    """What model.name refuses in the config, the library refuses for a model handed in, in one line."""
    import vitrain
    from vitrain.models import create_model

    overrides = ["train.max_steps=1", f"log.out_dir={tmp_path}", "log.progress=false", "parallel.strategy=zero3",
                 "parallel.sharded_init=true", "model.preset=vit_tiny_patch16", "model.image_size=32"]  # fmt: skip
    with pytest.raises(ConfigError, match=r"^parallel.sharded_init splits or draws vitrain's ViT by its anatomy; the "
                       r"model handed in \(UserNet\) is not it"):  # fmt: skip
        vitrain.train("digits", overrides, model=lambda cfg: UserNet(cfg.in_chans, cfg.num_classes))
    cfg = vitrain.load_config("digits", overrides)
    with pytest.raises(ConfigError, match="the model was handed in built: hand in a function of the config"):
        vitrain.train("digits", overrides, model=create_model(cfg.model))
    assert not any(tmp_path.iterdir())  # refused before the run folder is made


class FlatNet(nn.Module):
    """A model with no repeated block: one unit for every strategy; what needs blocks refuses in one line."""

    def __init__(self, cfg):  # noqa: ANN001
        super().__init__()
        self.conv = nn.Conv2d(cfg.in_chans, 8, kernel_size=4, stride=4)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, cfg.num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.conv(images).flatten(2).mean(dim=2)))


def test_a_model_without_repeated_blocks_trains_and_checkpointing_it_is_refused(tmp_path, capsys):
    overrides = ["model.name=tests.test_bring_your_own:FlatNet", "train.max_steps=2", "train.epochs=1"]
    overrides += ["log.progress=false", f"log.out_dir={tmp_path}", "precision.mode=amp_o2"]
    assert main(["train", "digits", *overrides]) == 0
    assert main(["train", "digits", *overrides, "parallel.activation_checkpointing=block", "name=ac"]) == 2
    assert "recomputes repeated blocks, and this model has no ModuleList of one class; name its block class with " \
        "parallel.block=NAME" in capsys.readouterr().err  # fmt: skip


def test_autotune_never_steps_a_module_handed_to_the_library(tmp_path, monkeypatch):
    import vitrain

    monkeypatch.setenv("VITRAIN_AUTOTUNE", "1")
    net = UserNet(1, 10)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    cfg = vitrain.load_config("digits", ["train.max_steps=1", f"log.out_dir={tmp_path}", "log.progress=false"])
    trainer = vitrain.Trainer(cfg, model=net)
    try:
        assert trainer.tuned is not None and trainer.tuned.images_per_s  # the candidates ran
        for name, tensor in net.state_dict().items():
            # The trainer may have moved it to a GPU.
            assert torch.equal(tensor.float().cpu(), before[name].float()), name
    finally:
        trainer.close()


def _fp32_modules_cfg(out_dir, name, parallel, batch_size=8):
    return tiny_config(out_dir, name, batch_size=batch_size, model={"name": "tests.test_bring_your_own:user_net"},
                       precision={"mode": "amp_o2", "dtype": "bf16", "fp32_modules": ["UserBlock"]},
                       parallel=parallel)  # fmt: skip


def _fp32_modules_sharded(out_dir):
    from vitrain.engine import Trainer

    # zero3: each block (its class named) is its own fp32 unit, not a second unit of its own.
    trainer = Trainer(_fp32_modules_cfg(out_dir, "zero3", {"strategy": "zero3", "wrap": "block"}))
    try:
        trainer.fit()
    finally:
        trainer.close()
    trainer = Trainer(_fp32_modules_cfg(out_dir, "zero2", {"strategy": "zero2"}))
    seen = {}
    for name, module in trainer.model.named_modules():
        if isinstance(module, nn.Linear | nn.LayerNorm):
            module.register_forward_pre_hook(
                lambda m, args, name=name: seen.setdefault(name, str(args[0].dtype)) and None
            )
    try:
        trainer.fit()
    finally:
        trainer.close()
    (out_dir / f"seen{torch.distributed.get_rank()}.json").write_text(json.dumps(seen))


# slow: 22 s on a Zen 4; fp32_modules under one process and a user's module under zero3 run in the default suite
@pytest.mark.slow
def test_layers_named_in_fp32_modules_compute_in_fp32_under_zero2_and_zero3_on_two_ranks_like_one_process(tmp_path):
    from tests.distributed_helpers import losses
    from vitrain.engine import Trainer

    Trainer(_fp32_modules_cfg(tmp_path, "single", {"strategy": "single"}, batch_size=16)).fit()  # 2 ranks x 8
    run_two_ranks(_fp32_modules_sharded, tmp_path)
    reference = losses(tmp_path / "single")
    for strategy in ("zero2", "zero3"):
        got = losses(tmp_path / strategy)
        assert sorted(got) == [1, 2, 3, 4, 5]
        for step, loss in reference.items():
            assert got[step] == pytest.approx(loss, rel=1e-2), (strategy, step)
    seen = json.loads((tmp_path / "seen0.json").read_text())
    # Each kept UserBlock gets its input upcast (FSDP2's cast); the layers outside compute in bf16.
    assert seen["layers.0.fc1"] == seen["layers.2.norm"] == "torch.float32"
    assert seen["classifier"] == "torch.bfloat16"


def test_layers_named_in_fp32_modules_stay_fp32_inside_and_out_under_amp_o2(tmp_path):
    from vitrain.engine import Trainer

    cfg = tiny_config(tmp_path, "fp32mods", model={"name": "tests.test_bring_your_own:user_net"},
                      precision={"mode": "amp_o2", "dtype": "bf16", "fp32_modules": ["UserBlock"]})  # fmt: skip
    trainer = Trainer(cfg)
    try:
        working = trainer.forward.module  # the low-dtype working copy behind the casts
        assert working.layers[0].fc1.weight.dtype == torch.float32  # inside a kept UserBlock
        assert working.stem.weight.dtype == torch.bfloat16 and working.classifier.weight.dtype == torch.bfloat16
        assert trainer.fit()["steps"] == 5
    finally:
        trainer.close()


# ------------------------------------------------------------------ data, model outputs and tasks that do not fit

HANDED = ["train.max_steps=1", "train.batch_size=16", "log.progress=false", "precision.mode=fp32", "model.depth=1",
          "model.image_size=16", "model.patch_size=4", "model.width=32", "model.heads=2"]  # fmt: skip


def image_set(n: int = 32, channels: int = 1, images: torch.Tensor | None = None, labels: torch.Tensor | None = None):
    """A random 10-class ImageSet of n 16x16 images (or the images and labels given)."""
    draw = torch.Generator().manual_seed(0)
    if images is None:
        images = torch.randint(0, 256, (n, channels, 16, 16), dtype=torch.uint8, generator=draw)
    return ImageSet(images, torch.arange(len(images)) % 10 if labels is None else labels, [str(k) for k in range(10)])


def refused(tmp_path: Path, error: type, pattern: str, at_set_up: bool = True, **handed) -> None:  # noqa: ANN003
    """vitrain.train with `handed` (data=, model=, task=) stops with one line of `error` matching `pattern`: before
    the run folder is made (`at_set_up`), else at the first step, before any checkpoint."""
    import vitrain

    with pytest.raises(error, match=pattern) as raised:
        vitrain.train("digits", [*HANDED, f"log.out_dir={tmp_path}"], **handed)
    assert "\n" not in str(raised.value)
    assert not any(tmp_path.iterdir()) if at_set_up else not list(tmp_path.rglob("step_*"))


def _pair():  # noqa: ANN202
    return image_set(), image_set(16)


@pytest.mark.parametrize(
    ("make", "pattern"),
    [
        (lambda: image_set(), r"^data= gave an ImageSet, not a \(train, val\) pair of datasets with classes, channels"),
        (lambda: (*_pair(), image_set()), r"^data= gave a tuple of 3, not a \(train, val\) pair"),
        (lambda: lambda cfg: None, r"^data= gave a NoneType, not a \(train, val\) pair"),
        (lambda: lambda: _pair(), r"^data= is a function that cannot be called with the config alone; give a function"),
        (
            lambda: (torch.zeros(8, 1, 16, 16), torch.zeros(8)),
            r"^data=: the train set \(a Tensor\) has no classes, "
            r"channels, read; give .*; wrap tensors as vitrain.data.ImageSet\(images, labels, classes\)$",
        ),
        (
            lambda: (image_set(), torch.utils.data.TensorDataset(torch.zeros(8))),
            r"^data=: the val set \(a "
            r"TensorDataset\) has no classes, channels, read; give a \(train, val\) pair",
        ),
    ],  # fmt: skip
    ids=["one-set", "three-sets", "function-gives-none", "function-of-nothing", "tensors", "torch-dataset"],
)
def test_data_handed_in_that_is_not_a_train_val_pair_of_datasets_is_one_line_naming_data(tmp_path, make, pattern):
    refused(tmp_path, DataError, pattern, data=make())


@pytest.mark.parametrize(
    ("val", "pattern"),
    [
        (
            image_set(16, channels=3),
            r"^data=: the val set has 3-channel images but the train set 1-channel images "
            r"\(model.in_chans=1\); give both the same$",
        ),
        (
            ImageSet(torch.zeros(4, 1, 16, 16, dtype=torch.uint8), torch.zeros(4, dtype=torch.long), ["a", "b"]),
            r"^data=: the val set's 2 class names differ from the train set's 10 \(a label is an index into them\)",
        ),
        (
            ImageSet(
                torch.zeros(4, 1, 16, 16, dtype=torch.uint8),
                torch.zeros(4, dtype=torch.long),
                [str(k) for k in reversed(range(10))],
            ),
            r"^data=: the val set's 10 class names differ from the train set's 10 .* in the same order$",
        ),
        (image_set(0), r"^data= gives an empty val set; every run is evaluated on it: give it samples$"),
    ],  # fmt: skip
    ids=["channels", "classes", "class-order", "empty"],
)
def test_a_val_set_handed_in_is_checked_like_the_train_set_before_training(tmp_path, val, pattern):
    """A val set the model cannot read failed at the first evaluation (all training before it lost); an empty one
    wrote val_loss NaN into summary.json."""
    refused(tmp_path, DataError, pattern, data=(image_set(), val))


@pytest.mark.parametrize(
    ("train", "pattern"),
    [
        (
            image_set(labels=torch.arange(32.0) % 10),
            r"^data=: the train set's labels are torch.float32 \(32,\); give "
            r"class indices, a torch.long tensor \(N,\)$",
        ),
        (
            image_set(labels=torch.arange(32) % 11),
            r"^data=: the train set's labels run from 0 to 10, but it has 10 "
            r"classes; labels are class indices in \[0, 10\)",
        ),
        (
            image_set(images=torch.rand(32, 1, 16, 16)),
            r"^data=: the train set's images are torch.float32 in \[0, 1\]; vitrain "
            r"reads images in 0-255",
        ),
        (
            image_set(images=torch.zeros(32, 16, 16, 1, dtype=torch.uint8)),
            r"^data=: the train set's images are "
            r"channels-last \(16, 16, 1\) per sample; images must be channels-first \(N, C, H, W\)",
        ),
        (
            image_set(images=torch.zeros(32, 16, 16, 3, dtype=torch.uint8)),
            r"^data=: the train set's images are channels-last \(16, 16, 3\) per sample",
        ),
    ],  # fmt: skip
    ids=["float-labels", "labels-past-classes", "float-images", "channels-last", "channels-last-rgb"],
)
def test_samples_handed_in_are_uint8_channels_first_images_with_class_index_labels(tmp_path, train, pattern):
    """One read at set-up: float labels, labels past the classes and HWC images failed in the step with torch's
    message (HWC: "set model.in_chans=16"), float images in [0, 1] trained silently near black."""
    refused(tmp_path, DataError, pattern, data=(train, image_set(16)))


def unit_float_source(cfg):  # noqa: ANN001, ANN201
    """`data.source=tests.test_bring_your_own:unit_float_source`: images as floats in [0, 1]."""
    return image_set(images=torch.rand(32, 1, 16, 16)), image_set(16)


def test_a_source_named_by_import_path_is_checked_like_data_handed_in(tmp_path):
    import vitrain

    with pytest.raises(DataError, match=r"^data.source=tests.test_bring_your_own:unit_float_source: the train set's "
                       r"images are torch.float32 in \[0, 1\]"):  # fmt: skip
        vitrain.train(
            "digits", [*HANDED, f"log.out_dir={tmp_path}", "data.source=tests.test_bring_your_own:unit_float_source"]
        )
    assert not any(tmp_path.iterdir())


def test_integer_labels_of_any_width_and_float_pixels_in_0_255_train_as_they_did(tmp_path):
    """What the checks above must not refuse: uint8 or int32 class indices (ImageSet makes them int64, as the loss,
    mixup and padding take) and float images in 0-255."""
    import vitrain

    train = image_set(images=image_set().images.float(), labels=(torch.arange(32) % 10).to(torch.uint8))
    val = image_set(16, labels=(torch.arange(16) % 10).to(torch.int32))
    assert train.labels.dtype == val.labels.dtype == torch.int64
    summary = vitrain.train("digits", [*HANDED, f"log.out_dir={tmp_path}"], data=(train, val))
    assert summary["steps"] == 1


class DrawingSet(ImageSet):
    """An ImageSet that draws from the global generator as it reads (as random clips do)."""

    def read(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        torch.rand(1)
        return super().read(index)


def test_the_set_up_read_of_a_handed_in_set_leaves_the_global_generator_as_it_was():
    """The model's initial weights, drawn after the data is built, stay those of the seed."""
    import vitrain
    from vitrain.data.sources import build_datasets

    cfg = vitrain.load_config("digits", HANDED)
    sets = tuple(DrawingSet(s.images, s.labels, s.classes) for s in (image_set(), image_set(16)))
    before = torch.get_rng_state()
    build_datasets(cfg, sets)
    assert torch.equal(torch.get_rng_state(), before)


class Outputs(nn.Module):
    """A linear classifier over the pixels whose output `shape_it` reshapes (or replaces)."""

    def __init__(self, outputs: int, shape_it=lambda logits: logits):  # noqa: ANN001
        super().__init__()
        self.linear, self.shape_it = nn.Linear(256, outputs), shape_it

    def forward(self, images: torch.Tensor):  # noqa: ANN201
        return self.shape_it(self.linear(images.flatten(1).float()))


@pytest.mark.parametrize(
    ("model", "got"),
    [
        (Outputs(5), r"shape \(16, 5\)"),
        (Outputs(100), r"shape \(16, 100\)"),
        (Outputs(10, lambda logits: logits.unsqueeze(1)), r"shape \(16, 1, 10\)"),
        (Outputs(10, lambda logits: (logits, logits)), "a tuple"),
    ],
    ids=["fewer-outputs", "more-outputs", "extra-dimension", "tuple"],
)
def test_a_model_whose_output_is_not_the_tasks_logits_is_one_line_naming_num_classes(tmp_path, model, got):
    """The task's loss checks the output (5 outputs for 10 classes failed with an IndexError, 100 trained with top-5
    over 100 classes): at the first step, before anything is trained."""
    pattern = rf"^the model's output is {got}, but classification takes logits of shape \(batch, model.num_classes\)"
    pattern += r" = \(16, 10\): set model.num_classes"
    refused(tmp_path, ConfigError, pattern, at_set_up=False, model=model, data=_pair())


def test_a_model_without_trainable_parameters_is_refused_at_set_up(tmp_path):
    pattern = r"^the model \(Flatten\) has no trainable parameters \(none with requires_grad\)"
    refused(tmp_path, ConfigError, pattern, model=nn.Flatten(), data=_pair())


def _task_without(*names: str) -> type:
    """ErrorRateTask without the methods `names`."""
    methods = {k: v for k, v in vars(ErrorRateTask).items() if k not in names and not k.startswith("__")}
    return type("HalfTask", (), {**methods, "__init__": ErrorRateTask.__init__})


@pytest.mark.parametrize(
    ("task", "pattern"),
    [
        (
            lambda cfg: object(),
            r"^task= is an object without build_data, build_model, .*, summary_defaults; give a "
            r"task object with the methods and attributes of vitrain.tasks.Task",
        ),
        (
            lambda cfg: "classification",
            r"^task= is the str 'classification', not a task object; to name one, set "
            r"task.name=classification instead$",
        ),
        (
            lambda cfg: ErrorRateTask,
            r"^task= is the class ErrorRateTask, not an instance of it; give "
            r"ErrorRateTask\(cfg, model, data\)$",
        ),
        (
            lambda cfg: _task_without("evaluate", "describe_data")(cfg),
            r"^task= is a HalfTask without evaluate, "
            r"describe_data; give a task object",
        ),
    ],  # fmt: skip
    ids=["object", "name", "class", "missing-methods"],
)
def test_a_task_handed_in_without_the_task_protocol_is_refused_before_the_run_folder(tmp_path, task, pattern):
    import vitrain

    refused(tmp_path, ConfigError, pattern, task=task(vitrain.load_config("digits", HANDED)))


def test_a_parallel_block_that_is_not_the_models_block_is_refused_for_every_model(tmp_path, capsys):
    base = ["train.max_steps=1", "train.epochs=1", "log.progress=false", f"log.out_dir={tmp_path}"]
    # vitrain's ViT plans its own units: a misspelt block was ignored, even with activation checkpointing asked for.
    assert main(["train", "digits", *base, "parallel.block=Blok", "parallel.activation_checkpointing=block"]) == 2
    assert "parallel.block=Blok is not this model's block: it plans its own units (Block)" in capsys.readouterr().err
    # Another model's block class that it lacks, on a plain run (nothing else reads the name there).
    flat = ["model.name=tests.test_bring_your_own:FlatNet", "name=flat"]
    assert main(["train", "digits", *base, *flat, "parallel.block=Blok"]) == 2
    assert "parallel.block=Blok names no module class of this model" in capsys.readouterr().err
    assert main(["train", "digits", *base, "parallel.block=Block", "name=named"]) == 0  # its own name is accepted


def test_a_tasks_classes_reach_the_checkpoint_only_as_a_list_of_names():
    # A task's `classes` goes into meta.json for export (detection); a user's task keeping a count or a tensor under
    # that name made every save fail (list(10), a tensor's truth value, a number JSON cannot hold as a name).
    from types import SimpleNamespace

    from vitrain.engine.runs import class_names

    assert class_names(SimpleNamespace(classes=("cell", "dot"))) == ["cell", "dot"]
    for odd in (10, torch.arange(3), [], [1, 2], None, "cells"):
        assert class_names(SimpleNamespace(classes=odd)) is None
    assert class_names({"classes": ["cell"]}) == ["cell"] and class_names({"classes": []}) is None
