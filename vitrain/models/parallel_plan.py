"""The ViT's parallel plan, kept beside the model: which modules become sharding units, which are recomputed.

The generic strategy layer (vitrain/parallel) asks a model for its plan instead of naming ViT anatomy itself, as
torchtitan keeps each model's `parallelize` next to the model. Only modules are returned: no distributed code here.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class ParallelPlan:
    shard_units: list[nn.Module]  # each its own FSDP unit, innermost first; the whole model is wrapped last
    checkpoint_units: list[nn.Module]  # the repeated blocks that activation checkpointing may recompute


def vit_plan(model: nn.Module, wrap: str) -> ParallelPlan:
    """wrap=model: one unit; block: each block (peak = one block gathered); sublayer: each block's attention and
    MLP separately, then the block itself, whose own unit then holds just its two norms."""
    blocks = list(model.blocks)
    units: list[nn.Module] = []
    if wrap == "sublayer":
        units += [sub for block in blocks for sub in (block.attn, block.mlp)]
    if wrap in ("block", "sublayer"):
        units += blocks
    return ParallelPlan(shard_units=units, checkpoint_units=blocks)
