"""The ViT names its own sharding units and checkpointable blocks; the strategies only apply them."""

from __future__ import annotations

from vitrain.config import ModelConfig
from vitrain.models import create_model

TINY = ModelConfig(image_size=16, patch_size=4, in_chans=1, num_classes=3, width=32, depth=3, heads=2)


def test_block_wrap_makes_each_block_a_unit_and_every_block_checkpointable():
    model = create_model(TINY)
    plan = model.parallel_plan("block")
    assert plan.shard_units == list(model.blocks) and plan.checkpoint_units == list(model.blocks)


def test_sublayer_wrap_puts_attention_and_mlp_before_their_blocks():
    model = create_model(TINY)
    units = model.parallel_plan("sublayer").shard_units
    expected = [m for b in model.blocks for m in (b.attn, b.mlp)] + list(model.blocks)
    assert units == expected


def test_model_wrap_leaves_one_unit_for_the_strategy_to_wrap():
    assert create_model(TINY).parallel_plan("model").shard_units == []
