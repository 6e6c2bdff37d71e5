"""The ViT's parallel plan, kept beside the model: which modules become sharding units, which are recomputed.

The generic strategy layer (vitrain/parallel) asks a model for its plan instead of naming ViT anatomy itself, as
torchtitan keeps each model's `parallelize` next to the model. Only modules are returned: no distributed code here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

# Layers that low precision keeps in fp32 (parameters, running statistics and arithmetic); _NormBase covers every
# BatchNorm and InstanceNorm.
NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._NormBase)


@dataclass(frozen=True)
class ParallelPlan:
    shard_units: list[nn.Module]  # each its own FSDP unit, innermost first; the whole model is wrapped last
    checkpoint_units: list[nn.Module]  # the repeated blocks that activation checkpointing may recompute
    # Norm layers grouped by where they sit (each block's, then the rest): under low-precision sharding each group
    # is one fp32 FSDP unit inside its block's low-precision unit.
    norm_groups: list[list[nn.Module]]
    # A repeated block's input shape for a micro-batch of n images: what a one-block timing probe feeds it.
    block_input_shape: Callable[[int], tuple[int, ...]]


def vit_plan(model: nn.Module, wrap: str) -> ParallelPlan:
    """wrap=model: one unit; block: each block (peak = one block gathered); sublayer: each block's attention and
    MLP separately, then the block itself, whose own unit then holds just its two norms."""
    blocks = list(model.blocks)
    units: list[nn.Module] = []
    if wrap == "sublayer":
        units += [sub for block in blocks for sub in (block.attn, block.mlp)]
    if wrap in ("block", "sublayer"):
        units += blocks
    in_blocks = [[m for m in block.modules() if isinstance(m, NORM_TYPES)] for block in blocks]
    grouped = {id(m) for group in in_blocks for m in group}
    rest = [m for m in model.modules() if isinstance(m, NORM_TYPES) and id(m) not in grouped]
    norm_groups = [group for group in [*in_blocks, rest] if group]
    tokens, width = model.pos_embed.shape[1], model.cfg.width
    seq_first = model.cfg.layout == "seq_first"

    def block_input_shape(n: int) -> tuple[int, ...]:
        return (tokens, n, width) if seq_first else (n, tokens, width)

    return ParallelPlan(units, blocks, norm_groups, block_input_shape)
