"""Consolidated exports: fp32 safetensors under vitrain or timm names, and `model.init_from` to fine-tune from them."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed_helpers import tiny_config
from vitrain import checkpoint as ckpt
from vitrain.bench.peers import PeerMissing, import_timm
from vitrain.cli import main
from vitrain.engine import Trainer
from vitrain.errors import CheckpointError
from vitrain.models import create_model
from vitrain.parallel import unwrap
from vitrain.weights import load_pretrained, timm_kwargs


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


@pytest.mark.parametrize("variant", [{}, {"pool": "gap", "pos_embed": "sincos", "qkv_bias": False}])
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
