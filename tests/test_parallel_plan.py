"""The ViT names its own sharding units and checkpointable blocks; the strategies only apply them."""

from __future__ import annotations

import dataclasses

from tests.conftest import TINY_MODEL
from vitrain.models import create_model

TINY = dataclasses.replace(TINY_MODEL, num_classes=3, depth=3)


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
