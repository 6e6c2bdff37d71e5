"""The ViT's parallel plan, kept beside the model: sharding units, recomputed blocks and pipeline stages.

The generic strategy layer (vitrain/parallel) asks a model for its plan instead of naming ViT anatomy itself, as
torchtitan keeps each model's `parallelize` next to the model. Only modules are returned: no distributed code here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
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
    blocks = _blocks(model)
    units: list[nn.Module] = []
    if wrap == "sublayer":
        units += [sub for block in blocks for sub in (block.attn, block.mlp)]
    if wrap in ("block", "sublayer"):
        units += blocks
    in_blocks = [[m for m in block.modules() if isinstance(m, NORM_TYPES)] for block in blocks]
    grouped = {id(m) for group in in_blocks for m in group}
    rest = [m for m in model.modules() if isinstance(m, NORM_TYPES) and id(m) not in grouped]
    norm_groups = [group for group in [*in_blocks, rest] if group]
    # From the config: a later pipeline stage holds no position table.
    tokens = (model.cfg.image_size // model.cfg.patch_size) ** 2 + model.num_prefix_tokens
    width = model.cfg.width
    seq_first = model.cfg.layout == "seq_first"

    def block_input_shape(n: int) -> tuple[int, ...]:
        return (tokens, n, width) if seq_first else (n, tokens, width)

    return ParallelPlan(units, blocks, norm_groups, block_input_shape)


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks in order: a ModuleList in the model, a ModuleDict keyed by block index in a stage."""
    return list(model.blocks.values()) if isinstance(model.blocks, nn.ModuleDict) else list(model.blocks)


def stage_blocks(depth: int, stages: int) -> list[range]:
    """The blocks of each pipeline stage: `depth // stages` each, one more for the stages after the first while the
    remainder lasts (the first stage also embeds the patches)."""
    if not 1 <= stages <= depth:
        raise ValueError(f"{stages} pipeline stages need 1 to {depth} blocks' worth of stages")
    counts = [depth // stages] * stages
    for i in range(depth % stages):
        counts[1 + i] += 1
    starts = [sum(counts[:i]) for i in range(stages)]
    return [range(start, start + count) for start, count in zip(starts, counts, strict=True)]


class ViTStage(nn.Module):
    """The part of a ViT that pipeline stages hold: some blocks, the embedding with block 0, the head with the last.

    It takes the model's own modules under the model's own names (`blocks.7.attn.qkv.weight`: the blocks keep
    their index in a ModuleDict), so its state dict is a subset of the whole model's and DCP checkpoints move
    between a pipelined run and one process unchanged. Build the whole model, take the stages' parts, drop the
    model: what no part holds is freed (torchtitan's pipeline split does the same).

    `forward` runs the embedding (when held), the blocks in order, then the final norm and head (when held): on a
    part that holds consecutive blocks, exactly the model's forward over them.
    """

    def __init__(self, model: nn.Module, blocks: range | list[int]):
        super().__init__()
        self.cfg = model.cfg
        self.embed_dim = model.embed_dim
        self.num_prefix_tokens = model.num_prefix_tokens
        self.has_embedding = 0 in blocks
        self.has_head = self.cfg.depth - 1 in blocks
        if self.has_embedding:
            self.patch_embed = model.patch_embed
            self.cls_token = model.cls_token
            if isinstance(model.pos_embed, nn.Parameter):
                self.pos_embed = model.pos_embed
            else:  # sincos: a fixed table, not saved
                self.register_buffer("pos_embed", model.pos_embed, persistent=False)
            self.pos_drop = model.pos_drop
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in blocks})
        if self.has_head:
            self.norm, self.fc_norm, self.neck, self.head = model.norm, model.fc_norm, model.neck, model.head
        # The model's own embedding, final norm, pooling and head code, run on these modules (same names, config).
        self._model_class = type(model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Images (first stage) or the previous stage's tokens -> tokens for the next stage, or the model's output."""
        if self.has_embedding:
            x = self._model_class.embed(self, x)
        for block in self.blocks.values():
            x = block(x)
        if self.has_head:
            x = self._model_class.forward_head(self, self._model_class.final_norm(self, x))
            return x
        # Sent to the next stage: point-to-point sends take contiguous tensors only, and the token stream is a
        # strided view under pool=gap (no class token to concatenate) and under the seq_first layout.
        return x.contiguous()

    def complexity(self, batch_size: int = 1):  # noqa: ANN201 (vit's Complexity; vit imports this module)
        """The whole model's cost (the header's GFLOPs per image), not this part's."""
        from vitrain.models.vit import complexity

        return complexity(self.cfg, batch_size, self.embed_dim)

    def parallel_plan(self, wrap: str) -> ParallelPlan:
        return vit_plan(self, wrap)
