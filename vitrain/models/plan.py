"""Each model's parallel plan: which modules are sharding units, recomputed blocks and fp32 norms.

The strategy layer (vitrain/parallel) and the precision policies ask `plan_of(model, wrap)` instead of naming ViT
anatomy themselves, as torchtitan keeps each model's `parallelize` next to the model. vitrain's ViT gives its own
plan (`vit_plan`); any other module gets one from its repeated block (`parallel.block`, or the class of the largest
run of same-class children of one ModuleList/Sequential). Only modules are returned: no distributed code here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from vitrain.errors import ConfigError

# Layers that low precision keeps in fp32 (parameters, running statistics and arithmetic); _NormBase covers every
# BatchNorm and InstanceNorm.
NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._NormBase)


def keeps_fp32(module: nn.Module, names: tuple[str, ...] = ()) -> bool:
    """Whether low precision keeps `module` in fp32: every norm, and the classes named in precision.fp32_modules."""
    return isinstance(module, NORM_TYPES) or type(module).__name__ in names


@dataclass(frozen=True)
class ParallelPlan:
    shard_units: list[nn.Module]  # each its own FSDP unit, innermost first; the whole model is wrapped last
    checkpoint_units: list[nn.Module]  # the repeated blocks that activation checkpointing may recompute
    # The layers low precision keeps fp32 (vitrain/parallel/strategies.py): every norm of the model, one fp32 FSDP unit
    # under low-precision sharding; and the other kept-fp32 layers (precision.fp32_modules) grouped by where they sit,
    # each block's then the rest, one fp32 unit per group.
    norms: list[nn.Module]
    fp32_groups: list[list[nn.Module]]
    # A repeated block's input shape for a micro-batch of n images (of checkpoint unit i where the blocks differ):
    # what a one-block timing probe feeds it.
    block_input_shape: Callable[..., tuple[int, ...]]
    # Where the blocks differ in shape (MViT's stages): (the index of one block of each kind, how many blocks are of
    # that kind). A probe times each kind once and weighs it by its count. Empty: every block is like the first.
    block_kinds: tuple[tuple[int, int], ...] = ()

    def probes(self, n: int) -> list[tuple[nn.Module, tuple[int, ...], int]]:
        """What a timing probe runs for micro-batches of n: (a block, its input's shape, the blocks it stands for)."""
        if not self.block_kinds:
            return [(self.checkpoint_units[0], self.block_input_shape(n), 1)]
        return [(self.checkpoint_units[i], self.block_input_shape(n, i), count) for i, count in self.block_kinds]


def vit_plan(model: nn.Module, wrap: str) -> ParallelPlan:
    """wrap=model: one unit; block: each block (peak = one block gathered); sublayer: each block's attention and
    MLP separately, then the block itself, whose own unit then holds just its two norms."""
    blocks = _blocks(model)
    units: list[nn.Module] = []
    if wrap == "sublayer":
        units += [sub for block in blocks for sub in (block.attn, block.mlp)]
    if wrap in ("block", "sublayer"):
        units += blocks
    norms, groups = fp32_layers(model, blocks)
    # From the config: a later pipeline stage holds no position table.
    tokens = model.cfg.num_patches + model.num_prefix_tokens
    width = model.cfg.width
    seq_first = model.cfg.layout == "seq_first"

    def block_input_shape(n: int) -> tuple[int, ...]:
        return (tokens, n, width) if seq_first else (n, tokens, width)

    return ParallelPlan(units, blocks, norms, groups, block_input_shape)


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks in order: a ModuleList in the model, a ModuleDict keyed by block index in a stage."""
    return list(model.blocks.values()) if isinstance(model.blocks, nn.ModuleDict) else list(model.blocks)


def fp32_layers(
    model: nn.Module, blocks: list[nn.Module], names: tuple[str, ...] = ()
) -> tuple[list[nn.Module], list[list[nn.Module]]]:
    """The layers low precision keeps in fp32 (`keeps_fp32`): every norm of the model, in order; and the layers of the
    classes in `names` (precision.fp32_modules) that are not norms, grouped by where they sit: each block's, then the
    rest, empty groups left out."""

    def named(module: nn.Module) -> bool:
        return keeps_fp32(module, names) and not isinstance(module, NORM_TYPES)

    inner = inside_kept([m for m in model.modules() if named(m)])
    norms = [m for m in model.modules() if isinstance(m, NORM_TYPES) and id(m) not in inner]
    in_blocks = [[m for m in block.modules() if named(m) and id(m) not in inner] for block in blocks]
    grouped = {id(m) for group in in_blocks for m in group}
    rest = [m for m in model.modules() if named(m) and id(m) not in grouped and id(m) not in inner]
    return norms, [group for group in [*in_blocks, rest] if group]


def inside_kept(tops: list[nn.Module]) -> set[int]:
    """The ids of the modules inside `tops`, the top layers kept fp32 (`keeps_fp32`): they run in fp32 as part of
    their top, with no casts or units of their own (amp_o2's working copy, FSDP2's fp32 units)."""
    return {id(m) for top in tops for m in list(top.modules())[1:]}


def check_stages(stages: int, depth: int, name: str = "parallel.pipeline_stages") -> None:
    """Every pipeline stage holds a block: more stages than model.depth are refused, naming `name`."""
    if stages > depth:
        raise ConfigError(f"{name}={stages} must be <= model.depth={depth}: each stage holds a block")


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


def auto_wrap(strategy: str) -> str:
    """What parallel.wrap=auto is where autotune does not time it. zero2 keeps every unit gathered from forward to
    backward whatever its size, so the whole model is one unit: one all-gather and one reduce-scatter per step
    instead of one per block, each waiting for the slowest rank (measured faster, docs/performance.md). zero3 frees
    each unit after its forward: each block is one (peak = one block gathered)."""
    return "model" if strategy == "zero2" else "block"


def plan_of(model: nn.Module, wrap: str, block: str = "", fp32_modules: tuple[str, ...] = ()) -> ParallelPlan:
    """The model's own plan (`model.parallel_plan(wrap)`), or one read from its repeated blocks.

    `block`: the class name of the repeated block (`parallel.block`); empty: the longest ModuleList/Sequential whose
    children share one class. `fp32_modules`: class names grouped with the norms as fp32 units (a model of vitrain's
    own names its norms itself).
    """
    wrap = "block" if wrap == "auto" else wrap  # a sharded run resolves auto first (auto_wrap); here only blocks matter
    own = getattr(model, "parallel_plan", None)
    if own is not None:
        plan = own(wrap)
        kinds = sorted({type(m).__name__ for m in plan.checkpoint_units})
        if block and block not in kinds:
            raise ConfigError(
                f"parallel.block={block} is not this model's block: it plans its own units "
                f"({', '.join(kinds) or 'none'}); leave parallel.block empty for it"
            )
        named = [m for m in model.modules() if type(m).__name__ in fp32_modules and not keeps_fp32(m)]
        if not named:
            return plan
        inner = inside_kept(named)
        return dataclasses.replace(
            plan,
            norms=[m for m in plan.norms if id(m) not in inner],
            fp32_groups=[*plan.fp32_groups, *([m] for m in named if id(m) not in inner)],
        )
    blocks = repeated_blocks(model, block)
    units = list(blocks) if wrap in ("block", "sublayer") else []
    norms, groups = fp32_layers(model, blocks, fp32_modules)

    def no_probe(n: int) -> tuple[int, ...]:
        raise NotImplementedError("a model without its own parallel plan has no block input shape to probe")

    return ParallelPlan(units, blocks, norms, groups, no_probe)


def repeated_blocks(model: nn.Module, block: str = "") -> list[nn.Module]:
    """The modules of class `block` in order; without a name, the longest run of one class in a ModuleList or
    Sequential (a ViT's, a Swin stage's blocks), or none: the model is then one unit (what needs blocks refuses)."""
    if block:
        found = [m for m in model.modules() if type(m).__name__ == block]
        if not found:
            names = sorted({type(m).__name__ for m in model.modules()})
            raise ConfigError(f"parallel.block={block} names no module class of this model; it has: {', '.join(names)}")
        return found
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList | nn.Sequential):
            children = list(module.children())
            if len(children) > len(best) and len({type(c) for c in children}) == 1:
                best = children
    return best if len(best) >= 2 else []
