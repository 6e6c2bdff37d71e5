"""Optimizers: parameter groups, every kernel agreeing with the plain loop, the flat buffer, LAMB and LARS."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import TINY_MODEL
from vitrain.config import CONFIG_DIR, OptimConfig, load_config
from vitrain.errors import ConfigError
from vitrain.models import VisionTransformer, create_model
from vitrain.optim import build_optimizer, param_groups, resolve_impl
from vitrain.optim.lamb_lars import Lamb, Lars
from vitrain.optim.optimizers import layer_id

CPU = torch.device("cpu")
TINY_VIT = dataclasses.replace(TINY_MODEL, depth=3)  # three blocks: layer decay has depths to tell apart


def group_of(model, groups) -> dict[str, dict]:
    """Parameter name -> the group holding it."""
    owner = {id(p): g for g in groups for p in g["params"]}
    return {name: owner[id(p)] for name, p in model.named_parameters()}


def train(model, optimizer, steps: int = 3) -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x, y = torch.randn(8, 1, 16, 16, generator=gen), torch.randint(0, 10, (8,), generator=gen)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_no_weight_decay_on_norms_biases_position_embedding_and_class_token():
    model = create_model(TINY_VIT)
    owner = group_of(model, param_groups(model, OptimConfig(weight_decay=0.05)))
    for name in ("blocks.0.norm1.weight", "blocks.0.attn.qkv.bias", "pos_embed", "cls_token", "norm.bias"):
        assert owner[name]["weight_decay"] == 0.0, name
    for name in ("blocks.0.attn.qkv.weight", "blocks.2.mlp.fc2.weight", "patch_embed.proj.weight", "head.weight"):
        assert owner[name]["weight_decay"] == 0.05, name


def test_head_gets_its_own_lr_scale_and_weight_decay():
    model = create_model(TINY_VIT)
    cfg = OptimConfig(weight_decay=0.05, head_lr_scale=10.0, head_weight_decay=0.0)
    owner = group_of(model, param_groups(model, cfg))
    assert owner["head.weight"]["lr_scale"] == 10.0 and owner["head.weight"]["weight_decay"] == 0.0
    assert owner["blocks.0.attn.qkv.weight"]["lr_scale"] == 1.0


def test_layer_decay_scales_lr_by_depth_from_the_head():
    model = create_model(TINY_VIT)  # 3 blocks: embeddings are layer 0, blocks 1..3, head and final norm 4
    owner = group_of(model, param_groups(model, OptimConfig(layer_decay=0.5)))
    assert owner["head.weight"]["lr_scale"] == 1.0
    assert owner["norm.weight"]["lr_scale"] == 1.0
    assert owner["blocks.2.mlp.fc1.weight"]["lr_scale"] == 0.5
    assert owner["blocks.0.mlp.fc1.weight"]["lr_scale"] == 0.125
    assert owner["patch_embed.proj.weight"]["lr_scale"] == 0.0625
    assert owner["pos_embed"]["lr_scale"] == 0.0625


def test_the_distillation_token_and_head_are_grouped_as_the_class_token_and_head():
    # As timm's DeiT: dist_token is in no_weight_decay() and in the embeddings' layer (group_matcher's stem), and
    # head_dist is a classifier like head. Before, dist_token had weight decay 0.05 and lr_scale 1.0 under
    # layer_decay=0.75 (cls_token: 0 and 0.42), and head_dist kept the blocks' lr and weight decay.
    model = VisionTransformer(TINY_VIT, distilled=True)
    cfg = OptimConfig(weight_decay=0.05, layer_decay=0.75, head_lr_scale=10.0, head_weight_decay=0.01)
    owner = group_of(model, param_groups(model, cfg))
    for name in ("cls_token", "dist_token", "pos_embed"):
        assert owner[name]["weight_decay"] == 0.0, name
        assert owner[name]["lr_scale"] == pytest.approx(0.75**4), name  # 3 blocks: the embeddings 4 layers down
    for name in ("head", "head_dist"):
        assert owner[f"{name}.weight"]["lr_scale"] == 10.0 and owner[f"{name}.weight"]["weight_decay"] == 0.01, name
        assert owner[f"{name}.bias"]["lr_scale"] == 10.0 and owner[f"{name}.bias"]["weight_decay"] == 0.0, name


def test_timms_vit_names_sit_in_the_layers_of_timms_layer_decay():
    # timm's models (model.name=timm:...) are grouped by name too: its stem (group_matcher) is layer 0, register
    # tokens and the norm before the blocks included; before, they were at the top, with the head's lr.
    for name in ("patch_embed.proj.weight", "cls_token", "reg_token", "dist_token", "pos_embed", "norm_pre.weight"):
        assert layer_id(name, 12) == 0, name
    assert layer_id("blocks.3.attn.qkv.weight", 12) == 4
    assert layer_id("norm.weight", 12) == layer_id("fc_norm.weight", 12) == layer_id("head.weight", 12) == 13


def test_build_optimizer_sets_each_group_lr_from_its_scale():
    model = create_model(TINY_VIT)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-3, layer_decay=0.5), CPU)
    lrs = sorted({g["lr"] for g in optimizer.param_groups})
    assert lrs == pytest.approx([1e-3 / 16, 1e-3 / 8, 1e-3 / 4, 5e-4, 1e-3])


def test_auto_picks_flat_on_cpu_fused_on_cuda_and_foreach_for_lamb_and_lars():
    assert resolve_impl("auto", CPU, "adamw") == "flat"
    assert resolve_impl("auto", CPU, "sgd") == "flat"
    assert resolve_impl("auto", torch.device("cuda"), "adamw") == "fused"
    assert resolve_impl("auto", CPU, "lamb") == "foreach"
    assert resolve_impl("auto", CPU, "lars") == "foreach"


def test_sgd_under_fsdp2_gets_foreach_since_torchs_fused_sgd_has_no_rule_for_sharded_parameters(tmp_path, capsys):
    # zero2/zero3's parameters are DTensors: auto picked fused SGD, and the first step raised NotImplementedError
    # ("Operator aten._fused_sgd_.default does not have a sharding strategy registered"). AdamW's fused kernel has one.
    from vitrain.cli import main

    for strategy in ("zero2", "zero3"):
        assert resolve_impl("auto", CPU, "sgd", strategy) == "foreach"
        assert resolve_impl("auto", torch.device("cuda"), "sgd", strategy) == "foreach"
        assert resolve_impl("auto", CPU, "adamw", strategy) == "fused"
    assert resolve_impl("auto", CPU, "sgd", "ddp") == "fused"
    run = ["train", "digits", f"log.out_dir={tmp_path}", "parallel.strategy=zero2", "optim.name=sgd", "model.depth=1",
           "train.max_steps=2", "train.threads=1", "log.progress=false"]  # fmt: skip
    assert main(run) == 0
    assert "optimizer=sgd[foreach]" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"optim.impl=fused with optim.name=sgd under parallel.strategy=zero3: .* "
                       r"use optim.impl=foreach or auto$"):  # fmt: skip
        load_config(overrides=["parallel.strategy=zero3", "optim.name=sgd", "optim.impl=fused"])


def test_auto_falls_back_to_fused_when_a_group_cannot_be_flattened():
    model = create_model(TINY_VIT)
    model.head.to(torch.bfloat16)  # the decay group now mixes fp32 and bf16
    optimizer = build_optimizer(model, OptimConfig(impl="auto"), CPU)
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["fused"]


def test_explicit_flat_on_mixed_dtypes_names_the_fix():
    model = create_model(TINY_VIT)
    model.head.to(torch.bfloat16)
    with pytest.raises(ConfigError, match="optim.impl=flat cannot be used here: a parameter group mixes dtypes"):
        build_optimizer(model, OptimConfig(impl="flat"), CPU)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
@pytest.mark.parametrize("impl", ["foreach", "fused", "flat"])
def test_every_kernel_matches_the_loop(name, impl):
    results = {}
    for which in ("loop", impl):
        torch.manual_seed(0)
        model = create_model(TINY_VIT)
        train(model, build_optimizer(model, OptimConfig(name=name, lr=1e-2, impl=which), CPU))
        results[which] = model.state_dict()
    # Fused kernels round differently; on early Adam steps (m / sqrt(v) of tiny gradients) that shows at ~4e-5,
    # under 1% of one lr=1e-2 step.
    for key, tensor in results["loop"].items():
        torch.testing.assert_close(results[impl][key], tensor, rtol=1e-4, atol=1e-4, msg=key)


def test_flat_parameters_and_gradients_are_views_into_one_buffer_per_group():
    model = create_model(TINY_VIT)
    optimizer = build_optimizer(model, OptimConfig(impl="flat"), CPU)
    assert [len(g["params"]) for g in optimizer.param_groups] == [1, 1]  # decay / no decay
    buffers = {g["params"][0].untyped_storage().data_ptr() for g in optimizer.param_groups}
    assert {p.untyped_storage().data_ptr() for p in model.parameters()} == buffers
    train(model, optimizer, steps=1)
    flat_grads = {g["params"][0].grad.untyped_storage().data_ptr() for g in optimizer.param_groups}
    assert {p.grad.untyped_storage().data_ptr() for p in model.parameters()} == flat_grads  # zero_grad kept them
    assert all(float(g["params"][0].grad.abs().sum()) == 0.0 for g in optimizer.param_groups)


def test_flat_optimizer_state_round_trips():
    torch.manual_seed(0)
    model = create_model(TINY_VIT)
    optimizer = build_optimizer(model, OptimConfig(impl="flat"), CPU)
    train(model, optimizer, steps=2)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    train(model, optimizer, steps=1)
    expected = model.state_dict()

    fresh = create_model(TINY_VIT)
    fresh_opt = build_optimizer(fresh, OptimConfig(impl="flat"), CPU)
    fresh.load_state_dict(saved_model)
    fresh_opt.load_state_dict(saved_opt)
    train(fresh, fresh_opt, steps=1)
    for key, tensor in expected.items():
        assert torch.equal(fresh.state_dict()[key], tensor), key


@pytest.mark.parametrize("cls", [Lamb, Lars])
def test_lamb_and_lars_foreach_match_their_loop(cls):
    results = []
    for foreach in (False, True):
        torch.manual_seed(0)
        model = create_model(TINY_VIT)
        groups = param_groups(model, OptimConfig(weight_decay=0.05))
        train(model, cls(groups, lr=1e-2, foreach=foreach))
        results.append(model.state_dict())
    for key, tensor in results[0].items():
        torch.testing.assert_close(results[1][key], tensor, rtol=1e-5, atol=1e-6, msg=key)


def test_lamb_step_norm_follows_the_weight_norm():
    weight = torch.nn.Parameter(torch.full((4, 4), 2.0))  # ||w|| = 8
    weight.grad = torch.randn(4, 4)
    Lamb([weight], lr=0.1, weight_decay=0.0).step()
    # The first Adam update has |u| ~ 1 per element; the trust ratio rescales it to ||w||: step = lr * ||w||.
    assert float((weight.detach() - 2.0).norm()) == pytest.approx(0.1 * 8.0, rel=1e-4)


def test_lars_scales_the_step_by_the_trust_ratio():
    weight = torch.nn.Parameter(torch.full((2, 2), 3.0))  # ||w|| = 6
    weight.grad = torch.full((2, 2), 0.5)  # ||g|| = 1
    Lars([weight], lr=1.0, momentum=0.0, weight_decay=1e-9, trust_coefficient=0.01).step()
    # step = lr * coef * ||w|| / ||g + wd w|| * (g + wd w) = 0.06 * g
    torch.testing.assert_close(weight.detach(), torch.full((2, 2), 3.0 - 0.06 * 0.5), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_lamb_and_lars_train_a_vit_without_nan(name):
    torch.manual_seed(0)
    model = create_model(TINY_VIT)
    before = model.head.weight.detach().clone()
    train(model, build_optimizer(model, OptimConfig(name=name, lr=1e-2), CPU), steps=2)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert not torch.equal(model.head.weight, before)


def test_fused_lamb_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match="optim.impl=fused is not available for optim.name=lamb.*use optim.impl"):
        load_config(CONFIG_DIR / "digits.yaml", ["optim.name=lamb", "optim.impl=fused"])


def test_layer_decay_outside_0_1_is_refused():
    with pytest.raises(ConfigError, match=r"optim.layer_decay=1.5 must be in \(0, 1\]"):
        load_config(CONFIG_DIR / "digits.yaml", ["optim.layer_decay=1.5"])
