"""Optimizers: parameter groups (no decay on norms/biases/embeddings, head and layer-wise lr) and the fastest kernel."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from vitrain.config import OptimConfig
from vitrain.errors import ConfigError
from vitrain.optim.flat import flat_optimizer
from vitrain.optim.lamb_lars import Lamb, Lars
from vitrain.optim.muon import Muon

# The embedding tokens and tables, as timm's ViT/DeiT no_weight_decay(): also the distillation token (DeiT) and
# register tokens (timm's models run here too). They sit with the patch embedding at layer 0 (timm's stem group).
TOKEN_NAMES = ("pos_embed", "cls_token", "dist_token", "reg_token")
# Layer 0 for layer decay: timm's stem group (group_matcher), the norm before the blocks of its CLIP-style ViTs too.
STEM_PREFIXES = ("patch_embed.", "norm_pre.", *TOKEN_NAMES)
# The classifiers: the head and DeiT's distillation head, which timm's DeiT also treats as a head.
HEAD_PREFIXES = ("head.", "head_dist.")
# The optim.* keys that decide `param_groups`' grouping and may change on resume (optim.name, which decides Muon's
# groups, may not: runs.check_same_optimizer refuses it first).
GROUPED_BY = ("optim.weight_decay", "optim.head_weight_decay", "optim.layer_decay", "optim.head_lr_scale")
# Which kernels each optimizer has; `auto` takes the first one the device can run.
KERNELS = {
    "adamw": ("fused", "foreach", "loop", "flat"),
    "sgd": ("fused", "foreach", "loop", "flat"),
    "lamb": ("foreach", "loop"),
    "lars": ("foreach", "loop"),
    "muon": ("foreach",),  # Newton-Schulz per matrix, foreach AdamW for the rest
}


def layer_id(name: str, num_layers: int) -> int:
    """0 for the embeddings, i + 1 for blocks.i, num_layers + 1 for the final norm and the head."""
    if name.startswith(STEM_PREFIXES):
        return 0
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    return num_layers + 1


def uses_muon(name: str, param: torch.Tensor) -> bool:
    """optim.name=muon orthogonalizes the transformer blocks' weight matrices; embeddings, stem, norms, biases and
    the head keep AdamW (as in Jordan et al.: Muon is for the hidden layers' matrices). Only layers' weights: a
    block's other 2-D tensors (MViTv2's relative-position tables) are embeddings."""
    return param.ndim == 2 and name.startswith("blocks.") and name.endswith(".weight")


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """Groups keyed by (lr scale, weight decay): decay matrices only; optional head lr/wd and layer-wise lr decay.

    With optim.name=muon the key also says whether the group follows Muon's rule (`uses_muon`)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ConfigError(
            f"the model ({type(model).__name__}) has no trainable parameters (none with requires_grad) for the "
            "optimizer; give a model with some"
        )
    num_layers = 1 + max((int(n.split(".")[1]) for n, _ in named if n.startswith("blocks.")), default=-1)
    head_wd = head_weight_decay(cfg)
    groups: dict[tuple[float, float], dict] = {}
    for name, param in named:
        no_decay = param.ndim <= 1 or name.split(".")[-1] in TOKEN_NAMES
        is_head = name.startswith(HEAD_PREFIXES)
        lr_scale = cfg.layer_decay ** (num_layers + 1 - layer_id(name, num_layers))
        if is_head:
            lr_scale *= cfg.head_lr_scale
        weight_decay = 0.0 if no_decay else (head_wd if is_head else cfg.weight_decay)
        muon = {"muon": uses_muon(name, param)} if cfg.name == "muon" else {}
        group = groups.setdefault(
            (lr_scale, weight_decay, *muon.values()),
            {"params": [], "weight_decay": weight_decay, "lr_scale": lr_scale, "lr": cfg.lr * lr_scale, **muon},
        )
        group["params"].append(param)
    return list(groups.values())


def head_weight_decay(cfg: OptimConfig) -> float:
    """optim.head_weight_decay, or optim.weight_decay when it is not set."""
    return cfg.weight_decay if cfg.head_weight_decay is None else cfg.head_weight_decay


def resolve_impl(impl: str, device: torch.device, name: str = "adamw", strategy: str = "single") -> str:
    """What `optim.impl=auto` runs: the fastest kernel measured for the device (`vitrain bench optim` reruns it).

    CPU: flat (one fused call per group). ViT-S/16 AdamW on 2 shared cores: flat 43 ms, fused 1209 ms, loop 3248 ms
    per step, because every per-tensor kernel waits for both threads; on 1 thread flat ~37, fused ~40, loop ~173 ms.
    CUDA: fused (multi-tensor kernels already batch the launches; untested here). LAMB/LARS: foreach.
    Distributed strategies own the gradient buffers (DDP buckets, FSDP shards), so they never get flat.
    """
    if impl != "auto":
        return impl
    kernels = KERNELS[name]
    if "flat" in kernels and device.type == "cpu" and strategy == "single":
        return "flat"
    if "fused" in kernels and device.type in ("cpu", "cuda") and not fused_refused_by(name, strategy):
        return "fused"
    return "foreach"


def fused_refused_by(name: str, strategy: str) -> bool:
    """Whether FSDP2's sharded parameters (DTensors, parallel.strategy zero2/zero3) cannot take optimizer `name`'s
    fused kernel: torch 2.13 registers no sharding rule for `_fused_sgd_` (AdamW's has one)."""
    return name == "sgd" and strategy in ("zero2", "zero3")


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, device: torch.device, strategy: str = "single"
) -> torch.optim.Optimizer:
    impl = resolve_impl(cfg.impl, device, cfg.name, strategy)
    groups = param_groups(model, cfg)
    if impl == "flat":
        reason = "parallel.strategy owns the gradient buffers" if strategy != "single" else why_not_flat(groups)
        if reason is None:
            return flat_optimizer(_optimizer_class(cfg), groups, **_kwargs(cfg))
        if cfg.impl == "flat":
            raise ConfigError(f"optim.impl=flat cannot be used here: {reason}; use optim.impl=fused or auto")
        impl = "fused"  # auto: the next fastest
    cls, kwargs = optimizer_class_and_kwargs(cfg, impl)
    return cls(groups, **kwargs)


def build_head_optimizer(head: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer of a task's head outside the model (the identity head): optim.name with the head's own lr
    (optim.lr x optim.head_lr_scale) and weight decay (optim.head_weight_decay, default optim.weight_decay)."""
    if getattr(head, "sharded", False) and cfg.name in ("lamb", "lars"):
        raise ConfigError(
            f"optim.name={cfg.name} scales each tensor's step by its norm, which for a head sharded over ranks would "
            "depend on the number of ranks; use optim.name=adamw or sgd, or task.shard_head=false"
        )
    if cfg.name == "muon":  # the head is an output layer: AdamW, as Muon leaves it
        cfg = dataclasses.replace(cfg, name="adamw")
    if cfg.impl in ("fused", "foreach", "loop") and cfg.impl in KERNELS[cfg.name]:
        impl = cfg.impl
    else:  # auto (and flat, which the head's single tensor does not need): the fastest per-tensor kernel
        impl = "fused" if "fused" in KERNELS[cfg.name] and device.type in ("cpu", "cuda") else "foreach"
    group = {
        "params": [p for p in head.parameters() if p.requires_grad],
        "weight_decay": head_weight_decay(cfg),
        "lr_scale": cfg.head_lr_scale,
        "lr": cfg.lr * cfg.head_lr_scale,
    }
    cls, kwargs = optimizer_class_and_kwargs(cfg, impl)
    return cls([group], **kwargs)


def optimizer_class_and_kwargs(cfg: OptimConfig, impl: str) -> tuple[type[torch.optim.Optimizer], dict]:
    """The optimizer class and its constructor arguments for a per-tensor kernel (fused, foreach or loop)."""
    if cfg.name == "muon":  # one kernel of its own
        return Muon, _kwargs(cfg)
    return _optimizer_class(cfg), {"fused": impl == "fused", "foreach": impl == "foreach", **_kwargs(cfg)}


def why_not_flat(groups: list[dict]) -> str | None:
    """Flat buffers need plain tensors of one dtype and device per group (not sharded DTensors, say)."""
    for group in groups:
        params = group["params"]
        if any(type(p.data) is not torch.Tensor for p in params):
            return "the parameters are not plain tensors (sharded or wrapped)"
        if len({(p.dtype, p.device) for p in params}) > 1:
            return "a parameter group mixes dtypes or devices"
    return None


def _optimizer_class(cfg: OptimConfig) -> type[torch.optim.Optimizer]:
    return {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD, "lamb": Lamb, "lars": Lars, "muon": Muon}[cfg.name]


def _kwargs(cfg: OptimConfig) -> dict:
    if cfg.name in ("adamw", "lamb"):
        return {"lr": cfg.lr, "betas": cfg.betas, "eps": cfg.eps}
    if cfg.name == "muon":
        return {"lr": cfg.lr, "betas": cfg.betas, "eps": cfg.eps, "momentum": cfg.muon_momentum}
    if cfg.name == "sgd":
        return {"lr": cfg.lr, "momentum": cfg.momentum, "nesterov": cfg.nesterov and cfg.momentum > 0}
    return {"lr": cfg.lr, "momentum": cfg.momentum, "trust_coefficient": cfg.trust_coefficient}
