"""Consolidated exports: fp32 safetensors under vitrain or timm names, and `model.init_from` to fine-tune from them."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed_helpers import tiny_config
from vitrain import checkpoint as ckpt
from vitrain.bench.peers import PeerMissing, import_timm
from vitrain.cli import main
from vitrain.engine import Trainer
from vitrain.errors import CheckpointError, ConfigError
from vitrain.models import create_model
from vitrain.parallel import unwrap
from vitrain.weights import export, load_pretrained, timm_kwargs


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A model trained for two steps and its checkpoint directory."""
    cfg = tiny_config(tmp_path_factory.mktemp("export"), "src", train={"max_steps": 2})
    trainer = Trainer(cfg)
    trainer.fit()
    return cfg, unwrap(trainer.model).cpu(), ckpt.latest(cfg.run_dir)  # trained on a GPU where there is one


def _export(checkpoint, out, fmt):
    assert main(["export", str(checkpoint), str(out), "--format", fmt]) == 0
    return out / "model.safetensors"


def test_export_writes_the_trained_weights_in_fp32(trained, tmp_path):
    cfg, model, checkpoint = trained
    state = load_file(str(_export(checkpoint, tmp_path, "vitrain")))
    assert set(state) == set(model.state_dict())
    for name, tensor in model.state_dict().items():
        assert state[name].dtype == torch.float32
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0, msg=name)
    assert (tmp_path / "config.yaml").read_text().startswith("name: src")


def test_export_writes_the_class_names_given_and_an_overwrite_without_them_drops_the_file(trained, tmp_path):
    cfg, model, checkpoint = trained
    _export(checkpoint, tmp_path, "vitrain")  # synthetic data names no classes: "0", "1", ... are not written as names
    assert "classes" not in ckpt.read_meta(checkpoint) and not (tmp_path / "classes.json").exists()
    names = [f"kind {i}" for i in range(cfg.model.num_classes)]
    export(model, cfg, tmp_path, overwrite=True, classes=names)
    assert json.loads((tmp_path / "classes.json").read_text()) == names
    for bad, why in ((names[:1], "1 names for model.num_classes"), ("cats", "give a list of class names")):
        with pytest.raises(ConfigError, match=why):  # refused before a file is touched
            export(model, cfg, tmp_path, overwrite=True, classes=bad)
    assert json.loads((tmp_path / "classes.json").read_text()) == names
    export(model, cfg, tmp_path, overwrite=True, classes=["caf\udce9", *names[1:]])  # a name no UTF-8 encodes
    assert json.loads((tmp_path / "classes.json").read_text())[0] == "caf\udce9"
    export(model, cfg, tmp_path, overwrite=True)  # the library's export of a model without names: none stay behind
    assert not (tmp_path / "classes.json").exists() and (tmp_path / "model.safetensors").exists()
    mine = tmp_path / "onnx" / "classes.json"  # a file of that name is not replaced (or removed) without overwrite
    mine.parent.mkdir()
    mine.write_text("mine")
    with pytest.raises(CheckpointError, match="already holds classes.json; pass --overwrite"):
        export(model, cfg, mine.parent, "onnx")
    assert mine.read_text() == "mine"


def test_init_from_an_export_starts_from_its_weights(trained, tmp_path):
    cfg, model, checkpoint = trained
    weights = _export(checkpoint, tmp_path / "out", "vitrain")
    fresh = tiny_config(tmp_path, "finetune", model={"init_from": str(weights)})
    started = unwrap(Trainer(fresh).model).cpu()
    images = torch.randn(3, 3, 8, 8)
    model.eval(), started.eval()
    torch.testing.assert_close(started(images), model(images), rtol=0, atol=0)


def test_init_from_a_file_with_another_head_keeps_a_fresh_head(trained, tmp_path):
    cfg, model, checkpoint = trained
    weights = _export(checkpoint, tmp_path / "out", "timm")
    other = tiny_config(tmp_path, "ten", model={"num_classes": 10}).model
    target = create_model(other)
    with pytest.warns(UserWarning, match="the head starts from scratch"):
        load_pretrained(target, weights)
    torch.testing.assert_close(target.blocks[1].mlp.fc2.weight, model.blocks[1].mlp.fc2.weight)
    assert target.head.weight.shape == (10, 32)


def test_init_from_another_architecture_is_refused(trained, tmp_path):
    cfg, model, checkpoint = trained
    weights = _export(checkpoint, tmp_path / "out", "vitrain")
    deeper = create_model(tiny_config(tmp_path, "deep", model={"depth": 3}).model)
    with pytest.raises(CheckpointError, match="holds a different architecture: it lacks tensor blocks.2"):
        load_pretrained(deeper, weights)


def test_init_from_a_missing_file_names_the_field(tmp_path):
    with pytest.raises(CheckpointError, match="model.init_from=.*is not a file"):
        load_pretrained(create_model(tiny_config(tmp_path, "x").model), tmp_path / "nope.safetensors")


@pytest.mark.parametrize(
    "variant",
    [{}, {"pool": "gap", "pos_embed": "sincos", "qkv_bias": False}, {"width": 56, "mlp_dim": 244, "heads": 4}],
)
def test_timm_export_loads_strictly_into_timm_with_the_same_logits(tmp_path, variant):
    try:
        timm_vit = import_timm().models.vision_transformer
    except PeerMissing as missing:
        pytest.skip(str(missing))
    cfg = tiny_config(tmp_path, "timm", model=variant, train={"max_steps": 2})
    trainer = Trainer(cfg)
    trainer.fit()
    weights = _export(ckpt.latest(cfg.run_dir), tmp_path / "out", "timm")
    reference = timm_vit.VisionTransformer(**timm_kwargs(cfg.model))
    reference.load_state_dict(load_file(str(weights)), strict=True)
    ours = unwrap(trainer.model).cpu()
    reference.eval(), ours.eval()
    images = torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(reference(images), ours(images), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "arguments, line",
    [
        (lambda m, cfg: (m, None), r"^export\(model, cfg, out_dir, fmt\): cfg is None, not a vitrain Config; pass "),
        (lambda m, cfg: (m, "digits"), r"^export\(model, cfg, out_dir, fmt\): cfg is 'digits', not a vitrain Config"),
        (lambda m, cfg: (cfg, m), r"^export\(model, cfg, out_dir, fmt\): model is a Config, not a torch\.nn\.Module"),
        (lambda m, cfg: (m, cfg.model), r"^export\(model, cfg, out_dir, fmt\): cfg is a ModelConfig \(the model "),
    ],
)
def test_export_refuses_arguments_of_the_wrong_kind_before_writing_anything(
    arguments, line, tiny_model, tiny_cfg, tmp_path
):
    import vitrain

    with pytest.raises(ConfigError, match=line):
        vitrain.export(*arguments(tiny_model, tiny_cfg), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert vitrain.export(tiny_model, tiny_cfg, tmp_path / "out").is_file()  # the retry is not refused


@pytest.mark.parametrize(
    "options, line",
    [
        ({"out_dir": ""}, r"out_dir is ''; give a folder path"),  # it wrote into the working folder
        ({"overwrite": "no"}, r"^export\(\.\.\., overwrite=\): give True or False, not 'no'"),  # "no" was true
        ({"fmt": "onnx", "tolerance": "x"}, r"^export\(\.\.\., tolerance=\): give a number such as 1e-4"),
    ],
)
def test_export_refuses_options_of_the_wrong_kind_before_writing_anything(
    options, line, tiny_model, tiny_cfg, tmp_path
):
    import vitrain

    with pytest.raises(ConfigError, match=line):
        vitrain.export(tiny_model, tiny_cfg, **{"out_dir": tmp_path / "out", **options})
    assert not (tmp_path / "out").exists()


def test_timm_export_refuses_a_model_other_than_the_vit_its_config_describes(tiny_model, tiny_cfg, tmp_path):
    import vitrain

    not_vit = (
        r"^export --format timm is for vitrain's ViT \(model\.name=vit\); the model is a Linear: use --format vitrain"
    )
    with pytest.raises(CheckpointError, match=not_vit):
        vitrain.export(torch.nn.Linear(2, 2), tiny_cfg, tmp_path / "out", "timm")
    mismatch = r"^export --format timm: the model's weights do not match the config "
    deeper = vitrain.load_config(tiny_cfg, ["model.depth=3"])
    with pytest.raises(CheckpointError, match=mismatch + r"\(model\.depth=3, .*blocks\.2\.norm1\.weight is absent in"):
        vitrain.export(tiny_model, deeper, tmp_path / "out", "timm")
    wider = vitrain.load_config(tiny_cfg, ["model.width=64"])
    with pytest.raises(
        CheckpointError, match=mismatch + r"\(.*model\.width=64\): cls_token is 1x1x32 in the model, 1x1x64"
    ):
        vitrain.export(tiny_model, wider, tmp_path / "out", "timm")
    # Models that are not vitrain's ViT, each told which format holds its weights.
    timm_model = vitrain.load_config(tiny_cfg, ["model.name=timm:vit_tiny_patch16_224"])
    with pytest.raises(CheckpointError, match=r"is timm's own model, whose weights --format vitrain writes under timm"):
        vitrain.export(tiny_model, timm_model, tmp_path / "out", "timm")
    detector = vitrain.load_config(
        tiny_cfg, ["task.name=detection", "data.source=detection", "model.global_blocks=[1]"]
    )
    with pytest.raises(CheckpointError, match=r"task\.name=detection is a ViTDet .*: use --format vitrain or onnx$"):
        vitrain.export(tiny_model, detector, tmp_path / "out", "timm")
    assert not (tmp_path / "out").exists()
    assert vitrain.export(tiny_model, tiny_cfg, tmp_path / "out", "timm").is_file()


def test_timm_json_mlp_ratio_gives_timm_exactly_the_model_mlp_dim(tiny_model_cfg):
    # timm builds int(width * mlp_ratio) hidden features; 244 / 56 * 56 is just below 244 in floating point.
    cfg = tiny_model_cfg
    for width in [*range(1, 129), *range(136, 2049, 8), 1408, 1664]:
        for mlp_dim in [*range(width, 6 * width + 1, max(1, width // 16)), 244, 6144, 8192]:
            cfg.width, cfg.mlp_dim = width, mlp_dim
            ratio = timm_kwargs(cfg)["mlp_ratio"]
            assert int(width * ratio) == mlp_dim, (width, mlp_dim, ratio)
    cfg.width, cfg.mlp_dim = 192, 768
    assert timm_kwargs(cfg)["mlp_ratio"] == 4.0  # an exact ratio is written as it is


def test_timm_export_of_a_convolutional_stem_is_refused_in_one_line(tmp_path, capsys):
    cfg = tiny_config(tmp_path, "stem", model={"patch_embed": "conv", "stem_channels": [8, 16]}, train={"max_steps": 1})
    Trainer(cfg).fit()
    capsys.readouterr()
    assert main(["export", str(cfg.run_dir), str(tmp_path / "out"), "--format", "timm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.patch_embed=conv (a convolutional stem, channels [8,16]) has no timm" in err[0]
    assert err[0].endswith("use --format vitrain") and not (tmp_path / "out").exists()
    assert main(["export", str(cfg.run_dir), str(tmp_path / "out"), "--format", "vitrain"]) == 0
