"""The single-device ViT: exact size and cost, timm-compatible names, and its layout/pooling options."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from vitrain.bench.peers import import_timm
from vitrain.config import ModelConfig, load_config
from vitrain.models import PRESETS, complexity, count_parameters, create_model

# Parameter counts that timm publishes for these architectures (class token, 1000-class head, 224 px).
TIMM_PARAMS = {
    "vit_tiny_patch16": 5_717_416,
    "vit_small_patch16": 22_050_664,
    "vit_base_patch16": 86_567_656,
    "vit_large_patch16": 304_326_632,
    "vit_huge_patch14": 632_045_800,
}
# timm defines g/14 and G/14 by an MLP ratio: (embed_dim, depth, mlp_ratio).
TIMM_RATIO_ARCHS = {"vit_giant_patch14": (1408, 40, 48 / 11), "vit_gigantic_patch14": (1664, 48, 64 / 13)}


def small(**changes) -> ModelConfig:
    base = dict(image_size=32, patch_size=8, in_chans=3, num_classes=7, width=64, depth=2, heads=4)
    return ModelConfig(**{**base, **changes})


def timm_param_formula(dim: int, depth: int, ratio: float, patch: int, image: int = 224, classes: int = 1000) -> int:
    """timm's VisionTransformer, counted from its module list: hidden = int(dim * mlp_ratio)."""
    hidden = int(dim * ratio)
    tokens = (image // patch) ** 2 + 1
    attention = (3 * dim * dim + 3 * dim) + (dim * dim + dim)
    block = 2 * dim + attention + 2 * dim + (dim * hidden + hidden) + (hidden * dim + dim)
    return 3 * patch * patch * dim + dim + dim + tokens * dim + depth * block + 2 * dim + dim * classes + classes


def preset_cfg(name: str) -> ModelConfig:
    return load_config(None, [f"model.preset={name}"]).model


@pytest.mark.parametrize("name", sorted(TIMM_PARAMS))
def test_standard_presets_match_timm_published_counts(name):
    assert complexity(preset_cfg(name)).params == TIMM_PARAMS[name]


@pytest.mark.parametrize("name", sorted(TIMM_RATIO_ARCHS))
def test_giant_presets_match_timm_architecture(name):
    dim, depth, ratio = TIMM_RATIO_ARCHS[name]
    assert complexity(preset_cfg(name)).params == timm_param_formula(dim, depth, ratio, patch=14)


@pytest.mark.skipif(importlib.util.find_spec("timm") is None, reason="timm is not installed (optional peer)")
@pytest.mark.parametrize("name", [p.name for p in PRESETS.values() if p.timm_name])
def test_presets_match_timm_models_built_on_meta_device(name):
    timm = import_timm()  # beside the CPU torch wheel timm's torchvision needs vitrain/bench/peers.py's declarations
    with torch.device("meta"):
        # Some timm configs (vit_huge_patch14_224) default to no classifier; the presets count a 1000-class head.
        reference = timm.create_model(PRESETS[name].timm_name, pretrained=False, num_classes=1000)
    assert complexity(preset_cfg(name)).params == count_parameters(reference)


def test_large_presets_reach_120b():
    sizes = {name: complexity(preset_cfg(name)).params for name in PRESETS}
    assert 115e9 < sizes["vit_120b_patch14"] < 125e9
    assert all(preset_cfg(name).width % 8 == 0 for name in PRESETS)


@pytest.mark.parametrize("pool", ["cls", "gap"])
@pytest.mark.parametrize("pos_embed", ["learned", "sincos"])
def test_complexity_counts_exact_parameters(pool, pos_embed):
    cfg = small(pool=pool, pos_embed=pos_embed)
    assert complexity(cfg).params == count_parameters(create_model(cfg))


def test_complexity_flops_match_torch_flop_counter():
    # The manual attention path: torch's counter has no formula for the CPU fused-attention kernel.
    cfg = small(attention="manual")
    model = create_model(cfg).eval()
    with FlopCounterMode(display=False) as counter:
        model(torch.randn(3, 3, 32, 32))
    assert complexity(cfg, batch_size=3).flops == counter.get_total_flops()


def test_state_dict_uses_timm_names():
    names = set(create_model(small()).state_dict())
    expected = {
        "cls_token", "pos_embed", "patch_embed.proj.weight", "blocks.0.norm1.weight", "blocks.0.attn.qkv.weight",
        "blocks.0.attn.proj.bias", "blocks.1.mlp.fc1.weight", "blocks.1.mlp.fc2.bias", "norm.weight", "head.weight",
    }  # fmt: skip
    assert expected <= names


def test_gap_pooling_has_no_class_token_and_uses_fc_norm():
    names = set(create_model(small(pool="gap")).state_dict())
    assert "cls_token" not in names and "fc_norm.weight" in names and "norm.weight" not in names


@pytest.mark.parametrize("pool", ["cls", "gap"])
def test_seq_first_layout_computes_the_same_function(pool):
    torch.manual_seed(0)
    batch_first = create_model(small(pool=pool)).eval()
    seq_first = create_model(small(pool=pool, layout="seq_first")).eval()
    seq_first.load_state_dict(batch_first.state_dict())
    images = torch.randn(4, 3, 32, 32)
    torch.testing.assert_close(seq_first(images), batch_first(images), rtol=1e-5, atol=1e-5)


def test_fused_attention_matches_manual():
    torch.manual_seed(0)
    fused = create_model(small()).eval()
    manual = create_model(small(attention="manual")).eval()
    manual.load_state_dict(fused.state_dict())
    images = torch.randn(4, 3, 32, 32)
    torch.testing.assert_close(fused(images), manual(images), rtol=1e-5, atol=1e-5)


def test_drop_path_is_random_in_training_and_off_in_eval():
    torch.manual_seed(0)
    model = create_model(small(drop_path=0.5))
    images = torch.randn(4, 3, 32, 32)
    model.train()
    assert not torch.equal(model(images), model(images))
    model.eval()
    assert torch.equal(model(images), model(images))


def test_class_token_and_position_init_follow_timm():
    torch.manual_seed(0)
    model = create_model(small())
    assert model.cls_token.abs().max() < 1e-4
    assert 0.01 < model.pos_embed.std() < 0.03
    assert torch.all(model.blocks[0].attn.qkv.bias == 0)
