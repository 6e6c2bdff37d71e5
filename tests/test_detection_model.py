"""The ViTDet backbone: windowed attention, the simple pyramid's shapes, exact size, pretrained starts, its plan."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vitrain.config import ModelConfig
from vitrain.models import VisionTransformer, count_parameters, plan_of
from vitrain.models.vitdet import (
    SimplePyramid,
    ViTDet,
    WindowedBlock,
    parameter_count,
    pyramid_strides,
    window_partition,
    window_unpartition,
)
from vitrain.weights import load_pretrained

TINY = ModelConfig(image_size=64, patch_size=8, width=32, depth=4, heads=2, num_classes=3, window_size=4,
                   global_blocks=(1, 3), attention="sdpa")  # fmt: skip


def test_window_partition_round_trips_a_map_that_needs_padding():
    x = torch.randn(2, 5, 7, 3)
    windows, padded = window_partition(x, 4)
    assert windows.shape == (2 * 2 * 2, 16, 3) and padded == (8, 8)
    assert torch.equal(window_unpartition(windows, 4, padded, (5, 7)), x)


def test_windowed_attention_equals_global_attention_when_the_window_covers_the_map():
    torch.manual_seed(0)
    windowed = WindowedBlock(TINY, 0.0, window=6)
    whole = WindowedBlock(TINY, 0.0, window=0)
    whole.load_state_dict(windowed.state_dict())
    x = torch.randn(2, 6, 6, 32)
    torch.testing.assert_close(windowed(x), whole(x))


def test_smaller_windows_attend_only_within_themselves():
    torch.manual_seed(0)
    block = WindowedBlock(TINY, 0.0, window=2).eval()
    x = torch.randn(1, 4, 4, 32)
    changed = x.clone()
    changed[0, 3, 3] += 1.0  # a token of the bottom-right window
    difference = (block(changed) - block(x)).abs().sum(-1)[0]
    assert difference[2:, 2:].gt(0).all() and difference[:2].eq(0).all() and difference[:, :2].eq(0).all()


def test_the_pyramid_matches_vitdet_shapes_for_a_1024_pixel_input():
    # ViTDet-B: width 768, patch 16, a 64 x 64 map at 1024 px -> 256 channels at strides 4, 8, 16, 32
    with torch.device("meta"):
        maps = SimplePyramid(768, 256)(torch.empty(1, 768, 64, 64))
    assert [tuple(m.shape) for m in maps] == [
        (1, 256, 256, 256),
        (1, 256, 128, 128),
        (1, 256, 64, 64),
        (1, 256, 32, 32),
    ]
    assert pyramid_strides(16) == (4, 8, 16, 32)


def test_vitdet_base_window_and_global_blocks_follow_the_config():
    cfg = ModelConfig(image_size=64, patch_size=16, width=32, depth=12, heads=2, window_size=14)
    with torch.device("meta"):
        model = ViTDet(cfg, 16, 1)
    assert [i for i, b in enumerate(model.blocks) if b.window == 0] == [2, 5, 8, 11]
    assert {b.window for b in model.blocks} == {0, 14}


def test_outputs_cover_every_point_of_the_four_levels():
    model = ViTDet(TINY, 32, 2)
    logits, boxes, centers = model(torch.randn(2, 3, 64, 64))
    points = model.points()
    assert points.centres.shape[0] == 32 * 32 + 16 * 16 + 8 * 8 + 4 * 4  # strides 2, 4, 8, 16 for patch 8
    assert logits.shape == (2, 1360, 3) and boxes.shape == (2, 1360, 4) and centers.shape == (2, 1360)
    assert boxes.min() >= 0  # distances to the sides


def test_parameter_count_is_exact():
    assert count_parameters(ViTDet(TINY, 32, 2)) == parameter_count(TINY, 32, 2)
    base = ModelConfig(image_size=1024, patch_size=16, width=768, depth=12, heads=12, num_classes=80)
    with torch.device("meta"):
        model = ViTDet(base, 256, 4)
    assert count_parameters(model) == parameter_count(base, 256, 4)


def test_a_vitrain_image_checkpoint_starts_the_backbone_with_positions_resampled(tmp_path):
    image_cfg = ModelConfig(image_size=32, patch_size=8, width=32, depth=4, heads=2, num_classes=10)
    source = VisionTransformer(image_cfg)
    path = tmp_path / "vit.pt"
    torch.save(source.state_dict(), path)
    model = ViTDet(TINY, 32, 2)
    load_pretrained(model, path)
    torch.testing.assert_close(model.blocks[2].mlp.fc1.weight, source.blocks[2].mlp.fc1.weight)
    assert model.pos_embed.shape == (1, 64, 32)  # 4 x 4 grid (class token row dropped) -> 8 x 8
    corner = source.pos_embed[0, 1]  # the grid's first position: bicubic resampling keeps it close at the corner
    assert torch.nn.functional.cosine_similarity(model.pos_embed[0, 0], corner, dim=0) > 0.9


def test_a_checkpoint_of_another_width_is_refused_in_one_line(tmp_path):
    other = VisionTransformer(ModelConfig(image_size=32, patch_size=8, width=64, depth=4, heads=2))
    torch.save(other.state_dict(), tmp_path / "vit.pt")
    with pytest.raises(Exception, match="patch_embed.proj.weight is .* there, .* here; set the model"):
        load_pretrained(ViTDet(TINY, 32, 2), tmp_path / "vit.pt")


def test_the_plan_shards_and_checkpoints_the_blocks():
    model = ViTDet(TINY, 32, 2)
    plan = plan_of(model, "block")
    assert plan.checkpoint_units == list(model.blocks) and plan.shard_units == list(model.blocks)
    assert plan.block_input_shape(3) == (3, 8, 8, 32)
    assert any(isinstance(m, torch.nn.GroupNorm) for m in plan.norms)  # the pyramid's and head's norms stay fp32


@pytest.mark.parametrize("global_blocks", [(1, 3), ()])
def test_flops_are_exact_with_padded_windows_and_global_blocks(global_blocks):
    from torch.utils.flop_counter import FlopCounterMode

    # window 3 on an 8 x 8 grid: padded to 9 x 9, whose padding tokens also pass the attention's projections.
    # manual attention: the counter sees its matmuls (it does not count sdpa's kernel on the CPU).
    cfg = dataclasses.replace(TINY, window_size=3, global_blocks=global_blocks, attention="manual")
    model = ViTDet(cfg, 16, 2)
    with FlopCounterMode(display=False) as counter:
        model(torch.randn(2, 3, 64, 64))
    assert model.complexity(batch_size=2).flops == counter.get_total_flops()


def test_layer_decay_lowers_the_backbone_lr_and_leaves_pyramid_and_head_at_full_lr():
    from vitrain.config import OptimConfig
    from vitrain.optim.optimizers import param_groups

    model = ViTDet(TINY, 32, 2)
    groups = param_groups(model, OptimConfig(layer_decay=0.5))
    scale_of = {id(p): g["lr_scale"] for g in groups for p in g["params"]}
    assert scale_of[id(model.patch_embed.proj.weight)] == 0.5**5  # 4 blocks: embeddings 5 layers below the top
    assert scale_of[id(model.blocks[3].mlp.fc1.weight)] == 0.5
    assert scale_of[id(model.pyramid.outputs[0][0].weight)] == 1.0 and scale_of[id(model.head.cls_logits.weight)] == 1.0
