"""Memory model: bytes per device for a ViT under single/ddp/zero1/zero2/zero3, offload and activation checkpointing.

Model states follow the ZeRO paper's accounting (Rajbhandari et al., 2020): weights, gradients, optimizer
states (AdamW: two fp32 moments) and, for mixed precision, an fp32 master copy of the weights. Each ZeRO
stage divides one more of them by the number of devices N:

    stage      weights    gradients   optimizer + master
    ddp        P w        P g         P (o + m)
    zero1      P w        P g         P (o + m) / N
    zero2      P w / N    P g / N     P (o + m) / N      + gathered weights (kept from forward to backward)
    zero3      P w / N    P g / N     P (o + m) / N      + the FSDP units in flight (one block each with wrap=block)

FSDP2 adds transient full-size copies: the all-gathered parameters of the unit being computed and of the one
being prefetched, and the unsharded gradients of a unit plus the flat buffer they are reduce-scattered from.
Activations are per device (they do not shrink with N): every block's saved tensors without checkpointing;
with per-block checkpointing only each block's input plus one block's tensors during its recompute.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vitrain.config import ModelConfig
from vitrain.errors import ConfigError
from vitrain.models import complexity

STRATEGIES = ("single", "ddp", "zero1", "zero2", "zero3")
# bytes per element: weights, gradients, optimizer moments, fp32 master copy, activations
PRECISIONS = {
    "fp32": (4, 4, 8, 0, 4),
    "bf16": (2, 2, 8, 4, 2),  # mixed precision: bf16 compute copies, fp32 master weights and moments
    "fp16": (2, 2, 8, 4, 2),
}
# FSDP2 units in flight at the peak (wrap=block): the block being computed plus the prefetched one.
UNITS_IN_FLIGHT = 2


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device at the training peak; `host_bytes` is what offload moves to CPU memory."""

    weights: int
    gradients: int
    optimizer: int
    master: int
    gathered: int  # transient unsharded parameters and gradients of FSDP units
    activations: int
    host_bytes: int = 0

    @property
    def model_states(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.master + self.gathered

    @property
    def total(self) -> int:
        return self.model_states + self.activations

    def as_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "model_states": self.model_states, "total": self.total}


def _block_params(cfg: ModelConfig) -> int:
    return complexity(dataclasses.replace(cfg, depth=2)).params - complexity(dataclasses.replace(cfg, depth=1)).params


def _sublayer_params(cfg: ModelConfig) -> int:
    """The larger of a block's two FSDP units under wrap=sublayer: attention or MLP."""
    d, h = cfg.width, cfg.hidden_dim
    attention = 3 * d * d + (3 * d if cfg.qkv_bias else 0) + d * d + d
    return max(attention, 2 * d * h + h + d)


def activation_bytes(cfg: ModelConfig, batch: int, ac: bool, bytes_per_element: int) -> int:
    """Saved activations of one training step on one device with `batch` images."""
    one = complexity(dataclasses.replace(cfg, depth=1), batch).activations
    block = complexity(dataclasses.replace(cfg, depth=2), batch).activations - one
    outside = one - block  # patch embedding, final norm, head
    if not ac:
        return (outside + cfg.depth * block) * bytes_per_element
    tokens = (cfg.image_size // cfg.patch_size) ** 2 + (1 if cfg.pool == "cls" else 0)
    block_input = batch * tokens * cfg.width
    return (outside + cfg.depth * block_input + block) * bytes_per_element


def estimate(
    cfg: ModelConfig,
    devices: int,
    strategy: str,
    wrap: str = "block",
    offload: bool = False,
    ac: bool = False,
    batch: int = 1,
    precision: str = "fp32",
    prefetch: bool = True,
) -> MemoryEstimate:
    """Per-device bytes for training `cfg` with AdamW on `devices` devices, `batch` images per device."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"strategy={strategy} is unknown; choose one of: {', '.join(STRATEGIES)}")
    if precision not in PRECISIONS:
        raise ConfigError(f"precision={precision} is unknown; choose one of: {', '.join(PRECISIONS)}")
    if devices <= 0 or batch <= 0:
        raise ConfigError(f"devices={devices} and batch={batch} must be positive")
    if offload and strategy not in ("zero2", "zero3"):
        raise ConfigError(f"offload needs strategy zero2 or zero3 (FSDP2), got {strategy}")
    w, g, o, m, a = PRECISIONS[precision]
    params = complexity(cfg).params
    n = devices if strategy != "single" else 1
    shard = {"single": (1, 1, 1), "ddp": (1, 1, 1), "zero1": (1, 1, n), "zero2": (n, n, n), "zero3": (n, n, n)}
    w_div, g_div, o_div = shard[strategy]
    weights, gradients = params * w // w_div, params * g // g_div
    optimizer, master = params * o // o_div, params * m // o_div
    gathered = 0
    if strategy in ("zero2", "zero3") and n > 1:
        unit = {"block": _block_params(cfg), "sublayer": _sublayer_params(cfg)}.get(wrap, params)
        units = min(UNITS_IN_FLIGHT if prefetch else 1, cfg.depth) if wrap != "model" else 1
        # Gradients: a unit's unsharded gradients plus the flat buffer they are reduce-scattered from.
        gathered = 2 * unit * g
        if strategy == "zero3":
            gathered += units * unit * w  # only the units in flight
            if wrap != "model":
                gathered += (params - cfg.depth * _block_params(cfg)) * w  # the root unit: embeddings, norm, head
        else:
            # zero2 keeps every unit's gathered weights from forward to backward. Backward releases them unit by
            # unit while the gradient shards fill up, so the peak is at its start: all gathered weights, no
            # gradient shards yet (the gradient term above stands for the same bytes, counted once).
            gathered += max(0, params * w - gradients)
    host = 0
    if offload:
        host = weights + gradients + optimizer + master
        weights = gradients = optimizer = master = 0
    return MemoryEstimate(
        weights=weights,
        gradients=gradients,
        optimizer=optimizer,
        master=master,
        gathered=gathered,
        activations=activation_bytes(cfg, batch, ac, a),
        host_bytes=host,
    )


def devices_needed(cfg: ModelConfig, device_bytes: int, max_devices: int = 1 << 16, **kwargs) -> int | None:
    """The fewest devices on which each device's share fits in `device_bytes` (None: not within max_devices).

    The share never grows with more devices, so doubling finds a bound and bisection the minimum.
    """

    def fits(n: int) -> bool:
        return estimate(cfg, devices=n, **kwargs).total <= device_bytes

    if fits(1):
        return 1
    if kwargs.get("strategy", "single") in ("single", "ddp") or not fits(max_devices):
        return None  # replicated state: more devices never lower the per-device share
    low, high = 1, 2
    while not fits(high):
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if fits(mid) else (mid, high)
    return high


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def table(device_gib: float, **kwargs) -> str:
    """One line per preset: per-device GiB under the given setting and the devices of `device_gib` it needs."""
    from vitrain.config import load_config
    from vitrain.models import PRESETS

    lines = [
        f"{'preset':<13}{'params':>16}{'states GiB':>12}{'activ. GiB':>12}{'total GiB':>11}{'host GiB':>10}"
        f"{f'devices@{device_gib:g}GiB':>17}"
    ]
    for preset in PRESETS.values():
        cfg = load_config(base={"model": {"preset": preset.name}}).model
        est = estimate(cfg, **kwargs)
        others = {k: v for k, v in kwargs.items() if k != "devices"}
        need = devices_needed(cfg, int(device_gib * 2**30), **others)
        lines.append(
            f"{preset.alias:<13}{complexity(cfg).params:>16,}{_gib(est.model_states):>12}{_gib(est.activations):>12}"
            f"{_gib(est.total):>11}{_gib(est.host_bytes):>10}{need if need else 'never':>17}"
        )
    return "\n".join(lines)


def breakdown(cfg: ModelConfig, device_gib: float, **kwargs) -> str:
    """The terms of one estimate, one per line, and the devices of `device_gib` it needs."""
    est = estimate(cfg, **kwargs)
    rows = [
        ("weights", est.weights),
        ("gradients", est.gradients),
        ("optimizer states", est.optimizer),
        ("fp32 master copy", est.master),
        ("FSDP units in flight", est.gathered),
        ("activations", est.activations),
        ("total per device", est.total),
        ("offloaded to host", est.host_bytes),
    ]
    lines = [f"{name:<22}{_gib(value):>10} GiB" for name, value in rows]
    others = {k: v for k, v in kwargs.items() if k != "devices"}
    need = devices_needed(cfg, int(device_gib * 2**30), **others)
    lines.append(f"devices of {device_gib:g} GiB needed: {need if need else 'none suffice (shard with zero3)'}")
    return "\n".join(lines)
