"""Activation checkpointing applied from outside the model: chosen blocks recompute their forward in backward."""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint


def apply_activation_checkpointing(blocks: list[nn.Module] | nn.ModuleList, mode: str, every_k: int = 2) -> int:
    """Make blocks keep only their input and recompute the rest during backward; returns how many.

    The block's `forward` is replaced on the instance (non-reentrant `torch.utils.checkpoint`), so parameter
    names, state dicts and FSDP wrapping are unchanged. `block` checkpoints every block; `every_k` every k-th
    block (0, k, 2k, ...), trading less recompute for more stored activations.
    """
    if mode == "none":
        return 0
    chosen = [b for i, b in enumerate(blocks) if mode == "block" or i % every_k == 0]
    for block in chosen:
        block.forward = functools.partial(_checkpointed, block.forward)
    return len(chosen)


def _checkpointed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
