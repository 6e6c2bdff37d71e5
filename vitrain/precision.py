"""Precision policies (fp32, AMP O1, AMP O2 with fp32 master weights, pure low precision) and fp16 loss scaling.

The trainer talks to one `PrecisionPolicy` through a narrow interface:

    forward_model = policy.prepare(model)      # before the optimizer is built over `model`
    with policy.autocast():
        loss = loss_fn(forward_model(images))  # logits come back fp32, so the loss is fp32
    policy.backward(loss)
    grad_norm, skipped = policy.step(optimizer, clip_grad_norm)

Modes (`precision.mode`, low dtype from `precision.dtype`):

- fp32: nothing changes.
- amp_o1: weights stay fp32; matmuls run in the low dtype under `torch.autocast`.
- amp_o2: `prepare` returns a working copy whose weights and activations are in the low dtype, except every norm
  layer (LayerNorm, RMSNorm, GroupNorm, BatchNorm; parameters and running statistics) which stays fp32, shared with
  the fp32 model and computed in fp32. The fp32 `model` is the master copy: the optimizer updates it and the
  working copy is refreshed from it after each step, so checkpoints always hold fp32 master weights. Under ddp and
  zero1 the working copy is what DDP replicates (its gradients averaged in `precision.reduce_dtype`). Under zero2
  and zero3 there is no working copy: the fp32 model is sharded, and FSDP2's `MixedPrecisionPolicy` gathers each
  unit's parameters in the low dtype for compute and reduce-scatters the gradients in `precision.reduce_dtype`
  onto the fp32 shards the optimizer updates; the norms are one fp32 unit (`ParallelPrecision`).
- pure (single, ddp): the model's weights are cast to the low dtype (norms included, though norms compute in fp32 and
  keep fp32 running statistics); no fp32 master copy. With `precision.compensated` (the default) each weight also
  keeps a low-dtype Kahan compensation term: the optimizer steps on fp32 `weight + compensation` made only for the
  step, its state is fp32, and what rounding to the low dtype drops is carried in the compensation to the next step,
  so small updates and weight decay accumulate as in fp32 (2 bytes per parameter more). Without it the optimizer
  updates the low-dtype weights directly with its state in the low dtype too (the least memory), and the accuracy risk
  is real: an update smaller than the low dtype's resolution next to a weight (bf16 keeps 8 significant bits, so lr x
  update below ~1/256 of |w|) is lost, weight decay mostly with it, and long runs or small learning rates drift from
  fp32. Checkpoints hold the weights upcast to fp32 (the weights the run evaluated with) and, beside them, the
  compensation, so that a resume continues bit for bit.

fp16 gets dynamic loss scaling in every mode (`LossScaler`); bf16 and fp32 need none.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import os
import shutil
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vitrain.config import Config, PrecisionConfig
from vitrain.device import (
    BF16_UNITS_ENV,
    DTYPES,
    LOW_DTYPES,
    bf16_emulated_here,
    cpu_has_bf16_matmul_units,
    key_compiled_cpu_kernels,
    resolve_device,
    synchronize,
)
from vitrain.errors import ConfigError, VitrainError
from vitrain.models.kernels import plain_graph
from vitrain.models.plan import inside_kept, keeps_fp32

SHARDED = ("zero2", "zero3")  # FSDP2 strategies: low-precision compute through MixedPrecisionPolicy


class TrainingDiverged(VitrainError):
    """Gradients or weights became inf/NaN beyond recovery; raised before anything bad is written."""


@dataclass(frozen=True)
class ParallelPrecision:
    """What a parallel strategy must do for amp_o2/pure: compute in `param_dtype` (norms in fp32), average gradients
    across ranks in `reduce_dtype`. FSDP2 turns it into MixedPrecisionPolicy units; DDP into a communication hook."""

    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    fp32_modules: tuple[str, ...] = ()  # class names kept in fp32 beside the norms (precision.fp32_modules)
    compile_norms: bool = False  # FSDP2's fp32 LayerNorms compute as CompiledFp32LayerNorm (precision.compile_norms)


@dataclass(frozen=True)
class Resolved:
    """What a config's precision means on one device, and why (auto explains its choice)."""

    mode: str  # fp32 | amp_o1 | amp_o2 | pure
    dtype: torch.dtype
    reason: str

    @property
    def label(self) -> str:
        return "fp32" if self.mode == "fp32" else f"{self.mode} {str(self.dtype).removeprefix('torch.')}"


def resolve(
    cfg: PrecisionConfig,
    device: torch.device,
    strategy: str = "single",
    time_modes: Callable[[], dict[str, float]] | None = None,
    pipelined: bool = False,
    decided: Resolved | None = None,
) -> Resolved:
    """Turn `precision.mode=auto` into a concrete policy for `device`; explicit modes pass through.

    Pipeline stages hold no low-dtype working copy, so `pipelined` outside zero2/zero3 keeps fp32 weights (amp_o1).

    `decided`: autotune's measured choice, which auto becomes where it is given (vitrain/engine/autotune.py); without
    it the rules below apply. On a CPU whose bf16 matmuls are not emulated, under zero2/zero3, `time_modes`
    (seconds of one block's forward and backward in fp32, amp_o1 and amp_o2, see `time_block_modes`; the average
    block where they differ, as MViT's stages do) picks the fastest.
    """
    if cfg.mode != "auto":
        dtype = torch.float32 if cfg.mode == "fp32" else LOW_DTYPES[cfg.dtype]
        reason = f"precision.mode={cfg.mode} set in the config"
        if dtype == torch.bfloat16 and (emulated := bf16_emulated_here(device.type)):
            reason += f"; {emulated}: precision.mode=auto or fp32 runs faster here"
        return Resolved(cfg.mode, dtype, reason)
    if decided is not None:  # autotune timed the candidates (vitrain/engine/autotune.py)
        return decided
    if device.type == "cuda":
        # CUDA branches are not exercised on the CPU-only machine this was developed on.
        if torch.cuda.is_bf16_supported() and pipelined and strategy not in SHARDED:
            return Resolved(
                "amp_o1",
                torch.bfloat16,
                f"auto: CUDA with bf16, pipeline stages under parallel.strategy={strategy} compute on fp32 weights "
                "-> bf16 O1",
            )
        if torch.cuda.is_bf16_supported():
            return Resolved("amp_o2", torch.bfloat16, "auto: CUDA with bf16 support -> bf16 O2 (no loss scaling)")
        return Resolved("amp_o1", torch.float16, "auto: CUDA without bf16 -> fp16 O1 with dynamic loss scaling")
    if device.type == "cpu":
        forced = f", forced by {BF16_UNITS_ENV}" if BF16_UNITS_ENV in os.environ else ""
        units = cpu_has_bf16_matmul_units()
        measurable = strategy in SHARDED and time_modes is not None
        # Without AMX, bf16 may still be the faster (avx512_bf16: Zen 4 and 5 run its GEMMs about twice fp32's) or
        # emulated (an AVX2 CPU: ~17x slower); measured, as autotune does, not read from the CPU's flags. Probed only
        # where the block's timing would follow: the fp32 rule below needs no probe.
        emulated = bf16_emulated_here(device.type) if measurable and not units else None
        has = f"AMX bf16 matmul units{forced}" if units else f"bf16 matmuls not emulated, no AMX{forced}"
        if measurable and emulated is None:
            seconds = time_modes()
            mode = min(seconds, key=seconds.get)
            measured = ", ".join(f"{m} {seconds[m] * 1e3:.1f} ms" for m in sorted(seconds))
            return Resolved(
                mode,
                torch.float32 if mode == "fp32" else torch.bfloat16,
                f"auto: CPU with {has}, parallel.strategy={strategy}: one block's forward and backward at this run's "
                f"shape measured {measured} -> the fastest, {mode}",
            )
        if units:
            # AMX CPUs run bf16 matmuls faster than fp32; autocast keeps fp32 weights.
            return Resolved("amp_o1", torch.bfloat16, f"auto: CPU with {has} -> bf16 O1")
        why = emulated or "no race decided it (autotune's race decides under single, ddp and zero1)"
        return Resolved("fp32", torch.float32, f"auto: CPU without AMX bf16 matmul units{forced}: {why} -> fp32")
    return Resolved("fp32", torch.float32, f"auto: device type {device.type} -> fp32")


def time_block_modes(
    block: nn.Module,
    shape: tuple[int, ...],
    repeats: int = 3,
    device: torch.device | None = None,
    compile_norms: bool = False,
) -> dict[str, float]:
    """Seconds (best of `repeats`, after a warm-up) of one forward and backward of a copy of `block` on an input
    of `shape`: in fp32, under bf16 autocast on fp32 weights (amp_o1) and with bf16 weights, norms fp32 (amp_o2;
    with `compile_norms` as the run computes them, their compile in the warm-up call)."""
    device = device or next(block.parameters()).device
    draw = torch.Generator(device).manual_seed(0)  # the run's own random stream is left alone
    fp32 = copy.deepcopy(block)
    if any(p.is_meta for p in fp32.parameters()):  # parallel.sharded_init: only the shapes matter for timing
        fp32.to_empty(device=device)
        for param in fp32.parameters():
            nn.init.normal_(param, std=0.02, generator=draw)
    low, _ = _working_copy(fp32, torch.bfloat16, compile_norms=compile_norms)
    x = torch.randn(shape, device=device, generator=draw)
    runs = {"fp32": (fp32, x, False), "amp_o1": (fp32, x, True), "amp_o2": (low, x.to(torch.bfloat16), False)}
    seconds = {}
    for mode, (module, inputs, autocast) in runs.items():
        timings = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                out = module(inputs)
            out.float().square().mean().backward()
            synchronize(device)
            timings.append(time.perf_counter() - start)
        seconds[mode] = min(timings[1:])  # the first call is the warm-up
    return seconds


class LossScaler:
    """Dynamic loss scaling for fp16: multiply the loss by `scale`; on inf/NaN gradients skip the step and halve it."""

    def __init__(self, cfg: PrecisionConfig):
        self.scale = cfg.init_scale
        self.min_scale = cfg.min_scale
        self.growth_interval = cfg.growth_interval
        self.max_overflows_at_min = cfg.max_overflows_at_min
        self.good_steps = 0  # finite steps since the last overflow or growth
        self.overflows_at_min = 0  # consecutive overflows while already at min_scale
        self.skipped_steps = 0

    def unscale_and_check(self, grads: list[torch.Tensor]) -> bool:
        """Divide `grads` by the scale in place; True when any is inf/NaN (one fused kernel per device/dtype)."""
        if not grads:
            return False
        found_inf = torch.zeros(1, device=grads[0].device)
        inv_scale = torch.full((1,), 1.0 / self.scale, device=grads[0].device)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for group in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv_scale)
        return bool(found_inf.item())

    def update(self, overflow: bool) -> None:
        if overflow:
            self.skipped_steps += 1
            self.good_steps = 0
            if self.scale <= self.min_scale:
                self.overflows_at_min += 1
                if self.overflows_at_min >= self.max_overflows_at_min:
                    raise TrainingDiverged(
                        f"fp16 gradients overflowed {self.overflows_at_min} steps in a row at the minimum loss "
                        f"scale precision.min_scale={self.min_scale}: the run is diverging; lower optim.lr, "
                        "use precision.dtype=bf16 or precision.mode=fp32 (checkpoints already written are kept)"
                    )
            self.scale = max(self.scale / 2.0, self.min_scale)
            return
        self.overflows_at_min = 0
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= 2.0
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = state["scale"]
        self.good_steps = state["good_steps"]
        self.skipped_steps = state["skipped_steps"]


class LowPrecisionIO(nn.Module):
    """Feeds `module` its images in the low dtype and hands fp32 logits back (the loss and softmax run in fp32);
    other arguments (token dropping's kept indices) pass as they are, and each logits tensor of a tuple (a distilled
    model's two heads) comes back in fp32."""

    def __init__(self, module: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.module = module
        self.dtype = dtype

    def forward(self, images: torch.Tensor, **kwargs: Any) -> torch.Tensor | tuple[torch.Tensor, ...]:
        output = self.module(images.to(self.dtype), **kwargs)
        return tuple(o.float() for o in output) if isinstance(output, tuple) else output.float()


def norm_in_fp32(module: nn.Module, args: tuple) -> tuple:
    """A forward pre-hook that hands a norm its floating-point inputs in fp32."""
    return tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def norm_output_to(dtype: torch.dtype):
    """A forward hook that hands a norm's fp32 output on in the low dtype the next layer's weights are in."""

    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return output.to(dtype)

    return hook


class _BatchNormInFp32:
    """Mixed into a BatchNorm's class by `batch_norms_in_fp32`: where its weights are in a lower dtype than its
    running statistics, it normalizes in fp32 (input, weight and bias upcast, the statistics as they are) and hands
    its output on in the input's dtype; otherwise it is the class it was."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = self._parameters  # type: ignore[attr-defined]
        weight, bias = params.get("weight"), params.get("bias")
        stats = self.running_mean  # type: ignore[attr-defined]
        if weight is None or stats is None or weight.dtype == stats.dtype:
            return super().forward(x)  # type: ignore[misc]
        try:  # the upcasts are differentiable: the gradients reach the low-dtype parameters
            params["weight"] = weight.float()
            if bias is not None:
                params["bias"] = bias.float()
            return super().forward(x.float()).to(x.dtype)  # type: ignore[misc]
        finally:
            params["weight"], params["bias"] = weight, bias


@functools.cache
def _in_fp32_class(cls: type) -> type:
    return type(cls.__name__, (_BatchNormInFp32, cls), {"__module__": cls.__module__})


def batch_norms_in_fp32(model: nn.Module) -> int:
    """Every BatchNorm of `model` normalizes in fp32 where its weights are in a lower dtype than its running
    statistics, as DeepSpeed's bf16/fp16 leaves them: since 0.19 it casts the parameters and not the buffers, and
    torch's batch_norm refuses bf16 weights beside fp32 statistics (on a CPU: "expected scalar type BFloat16 but found
    Float"). Only the class changes (`plain_batch_norms` changes it back); returns how many."""
    swapped = 0
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, _BatchNormInFp32):
            module.__class__ = _in_fp32_class(type(module))
            swapped += 1
    return swapped


def plain_batch_norms(model: nn.Module) -> None:
    """The BatchNorms `batch_norms_in_fp32` changed are of their own classes again."""
    for module in model.modules():
        if isinstance(module, _BatchNormInFp32):
            module.__class__ = type(module).__mro__[2]


def _layer_norm_in_fp32(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    shape: tuple[int, ...],
    eps: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return F.layer_norm(x.float(), shape, weight, bias, eps).to(out_dtype)


def _rows_in_fp32(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, out_dtype: torch.dtype
) -> torch.Tensor:
    """`_layer_norm_in_fp32` over the rows of a 2-D `x`, their width read from it (not a constant of the graph)."""
    return F.layer_norm(x.float(), (x.shape[-1],), weight, bias, eps).to(out_dtype)


@functools.cache
def _compiled_layer_norm(device_type: str) -> Callable[..., torch.Tensor]:
    """One compiled function for every norm of the run on a device kind. It takes rows: norms of other ranks and
    widths (MViT's stages and pooled heads) share a graph whose sizes turn dynamic on the first change, where each
    (rank, width) pair would compile its own and soon pass torch.compile's limit of 8 (the rest then run eager,
    with a warning). A model whose norms share one shape (the ViT) keeps one static graph."""
    key_compiled_cpu_kernels(device_type)
    return torch.compile(_rows_in_fp32)


class CompiledFp32LayerNorm(nn.LayerNorm):
    """amp_o2's LayerNorm with precision.compile_norms: fp32 weights, input and output in the low dtype, the upcast,
    the norm and the downcast compiled into one kernel forward and one backward (the plain path: a norm_in_fp32
    pre-hook and a norm_output_to hook, four passes more over the activations per call). Evaluation runs eager:
    no compile per evaluation batch shape."""

    out_dtype: torch.dtype  # the working copy's low dtype (what norm_output_to hands on)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or plain_graph():  # compile, export and tracing see the plain ops
            args = (x, self.weight, self.bias, tuple(self.normalized_shape), self.eps, self.out_dtype)
            return _layer_norm_in_fp32(*args)
        features = math.prod(self.normalized_shape)
        weight = None if self.weight is None else self.weight.reshape(features)
        bias = None if self.bias is None else self.bias.reshape(features)
        rows = _compiled_layer_norm(x.device.type)(x.reshape(-1, features), weight, bias, self.eps, self.out_dtype)
        return rows.reshape(x.shape)


def fp32_between(module: nn.Module, dtype: torch.dtype, compile_norms: bool) -> None:
    """Make `module` (fp32 weights) take its inputs upcast to fp32 and hand its output on in `dtype`: a plain
    LayerNorm under `compile_norms` as one compiled kernel, anything else through a pre-hook and a hook."""
    if compile_norms and type(module) is nn.LayerNorm:
        module.__class__ = CompiledFp32LayerNorm
        module.out_dtype = dtype
    else:
        module.register_forward_pre_hook(norm_in_fp32)
        module.register_forward_hook(norm_output_to(dtype))


def compile_norms_problem(device: torch.device) -> str | None:
    """Why precision.compile_norms cannot compile on `device` (None: it can): inductor builds C++ on a CPU and
    Triton kernels on a GPU."""
    if device.type == "cpu":
        compiler = _inductor_cxx()
        if not shutil.which(compiler):
            return f"the C++ compiler {compiler} ($CXX, else g++), which torch.compile builds CPU kernels with"
        if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
            return "Python's headers (Python.h), which torch.compile builds CPU kernels against"
        return None
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "Triton, which torch.compile needs on a GPU"
    return f"torch.compile's inductor backend on device type {device.type}"


def _inductor_cxx() -> str:
    """The C++ compiler inductor builds with: its config's where that is loaded (a user may have set it), else
    inductor's default read the same way, $CXX else g++ (clang++ on macOS), without importing inductor (seconds at
    start-up, for a run that may never compile)."""
    config = sys.modules.get("torch._inductor.config")
    if config is not None:
        return config.cpp.cxx[-1] or "g++"
    return os.environ.get("CXX", "clang++" if sys.platform == "darwin" else "g++")


def compiles_norms(setting: bool | str, device: torch.device) -> bool:
    """Whether amp_o2's norms compile under precision.compile_norms=`setting` on `device`. auto: on a CPU that can
    build inductor's kernels (ViT-S/16 and ViT-Ti/16 steps 1.03-1.07x on a 2-core Zen 4, docs/performance.md); off
    on a GPU, where its effect is not measured."""
    if setting == "auto":
        return device.type == "cpu" and compile_norms_problem(device) is None
    return bool(setting)


class PrecisionPolicy:
    """One precision mode applied from outside the model: preparation, autocast, loss scaling and the step."""

    def __init__(
        self,
        cfg: PrecisionConfig,
        device: torch.device,
        strategy: str = "single",
        time_modes: Callable[[], dict[str, float]] | None = None,
        pipelined: bool = False,
        decided: Resolved | None = None,
    ):
        self.resolved = resolve(cfg, device, strategy, time_modes, pipelined, decided)
        self.mode, self.dtype, self.device = self.resolved.mode, self.resolved.dtype, device
        self.strategy = strategy
        self.reduce_dtype = DTYPES[cfg.reduce_dtype]
        self.fp32_modules = cfg.fp32_modules  # class names kept in fp32 beside the norms (a user's model)
        self.compile_norms = cfg.compile_norms  # resolved where a working copy is made
        self.scaler = LossScaler(cfg) if self.dtype == torch.float16 else None
        # fp32/bf16: a step whose loss or gradients hold inf/NaN is skipped, up to this many in a row, then the
        # run stops (fp16 has the loss scaler's own policy: skip, halve the scale, stop at the minimum).
        self.max_nonfinite_skips = cfg.max_nonfinite_skips
        self.nonfinite_in_a_row = 0
        self.nonfinite_skipped = 0
        self.compensated = self.mode == "pure" and cfg.compensated
        # pure + compensated: Kahan compensation per optimizer parameter (a flat buffer's members get views of it).
        self.compensation: dict[nn.Parameter, torch.Tensor] = {}
        # (working low-dtype parameter, fp32 master parameter) pairs; filled by prepare() under amp_o2.
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []

    # ------------------------------------------------------------------------------------------ model

    def prepare(
        self,
        model: nn.Module,
        parallelize: Callable[[nn.Module, ParallelPrecision | None], nn.Module] | None = None,
    ) -> nn.Module:
        """Return the module to run forward/backward on; build the optimizer over `model` afterwards.

        `parallelize(module, parallel_precision)` applies the parallel strategy to the module that computes: the
        low-dtype working copy (amp_o2 under single, ddp, zero1) or `model` itself (FSDP2 shards the fp32 model
        and computes in the low dtype through `parallel_precision`).
        """
        named_nowhere = sorted(set(self.fp32_modules) - {type(m).__name__ for m in model.modules()})
        if named_nowhere and self.mode in ("amp_o2", "pure"):  # a misspelt class would silently stay low-precision
            classes = sorted({type(m).__name__ for m in model.modules()} - {"ModuleList", "Sequential", "Identity"})
            raise ConfigError(
                f"precision.fp32_modules names {', '.join(named_nowhere)}, which no layer of the model is; its "
                f"classes: {', '.join(classes)[:300]}"
            )
        working = model
        if self.mode == "pure":
            model.to(self.dtype)
            for module in model.modules():
                if keeps_fp32(module, self.fp32_modules):
                    _compute_in_fp32(module)
        elif self.mode == "amp_o2" and self.strategy not in SHARDED:
            compiled = compiles_norms(self.compile_norms, self.device)
            working, self.pairs = _working_copy(model, self.dtype, self.fp32_modules, compiled)
        computing = parallelize(working, self.parallel_precision()) if parallelize is not None else working
        if self.mode == "pure" or (self.mode == "amp_o2" and self.strategy not in SHARDED):
            return LowPrecisionIO(computing, self.dtype)
        return computing

    def parallel_precision(self) -> ParallelPrecision | None:
        """What the parallel strategy must apply for low-precision weights; None when the weights are fp32."""
        if self.mode in ("fp32", "amp_o1"):
            return None
        # Resolved only for FSDP2's amp_o2 (a DDP hook never reads it).
        compiled = (
            self.mode == "amp_o2" and self.strategy in SHARDED and compiles_norms(self.compile_norms, self.device)
        )
        return ParallelPrecision(self.dtype, self.reduce_dtype, self.fp32_modules, compiled)

    def sync_working_copy(self) -> None:
        """Refresh the low-dtype working weights from the fp32 master (after a step or a checkpoint load)."""
        if self.pairs:
            with torch.no_grad():
                torch._foreach_copy_([w for w, _ in self.pairs], [m for _, m in self.pairs])

    # ------------------------------------------------------------------------------------------ step

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.mode != "amp_o1":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.scaler.scale if self.scaler is not None else loss).backward()

    @property
    def loss_scale(self) -> float | None:
        return self.scaler.scale if self.scaler is not None else None

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        clip_grad_norm: float,
        loss_nonfinite: torch.Tensor | None = None,
        head_optimizer: torch.optim.Optimizer | None = None,
        norm_group: torch.distributed.ProcessGroup | None = None,
    ) -> tuple[float | None, bool]:
        """Unscale, check, clip and apply the gradients; returns (gradient norm before clipping, skipped).

        Collective under a parallel strategy: whether to skip is decided once for all ranks (a NaN loss on one
        rank, an inf in one rank's gradient shard), so every rank skips or steps together. `head_optimizer` steps
        parameters that live outside the model (the face task's fp32 identity head, one shard per rank): they are
        unscaled and checked with the model's, and not clipped (the norm is the model's). `norm_group`: the ranks
        whose parameters together make the model (pipeline stages); the norm that clips and is returned is theirs.
        """
        self._gradients_to_master()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        head_params = [p for group in head_optimizer.param_groups for p in group["params"]] if head_optimizer else []
        optimizers = [optimizer, head_optimizer] if head_optimizer is not None else [optimizer]
        if loss_nonfinite is None:
            loss_nonfinite = torch.zeros((), dtype=torch.bool, device=self.device)
        if self.scaler is not None:
            grads = [p.grad for p in params + head_params if p.grad is not None]
            overflow = self._any_rank(self.scaler.unscale_and_check(grads) | loss_nonfinite)
            self.scaler.update(overflow)
            if overflow:
                for each in optimizers:  # the weights are not touched: the whole step is skipped
                    each.zero_grad(set_to_none=True)
                return None, True
        with self.full_precision(optimizer, step=True) if self.compensated else contextlib.nullcontext():
            grads = [p.grad for p in params if p.grad is not None]  # under pure + compensated: fp32 now
            norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=self.device)
            # Sharded (FSDP2) gradients give a DTensor norm; its full value is reduced over every rank's shard.
            full_norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            if norm_group is not None:
                squared = full_norm.detach().float() ** 2
                torch.distributed.all_reduce(squared, group=norm_group)
                norm = full_norm = squared.sqrt()
            bad = ~torch.isfinite(full_norm) | loss_nonfinite
            head_grads = [p.grad for p in head_params if p.grad is not None]
            if head_grads:
                bad |= ~torch.isfinite(torch.nn.utils.get_total_norm(head_grads))
            if self._any_rank(bad):
                for each in optimizers:
                    each.zero_grad(set_to_none=True)
                self._skip_nonfinite()
                return None, True
            self.nonfinite_in_a_row = 0
            if clip_grad_norm > 0:
                torch.nn.utils.clip_grads_with_norm_(params, clip_grad_norm, norm)
            for each in optimizers:
                each.step()
        for each in optimizers:
            each.zero_grad(set_to_none=True)
        self.sync_working_copy()
        return float(full_norm), False

    def _any_rank(self, flag: torch.Tensor) -> bool:
        # A single-device policy decides alone, also inside a launched job (autotune's steps on rank 0).
        return bool(flag.item()) if self.strategy == "single" else any_rank(flag)

    def _skip_nonfinite(self) -> None:
        self.nonfinite_in_a_row += 1
        self.nonfinite_skipped += 1
        if self.nonfinite_in_a_row > self.max_nonfinite_skips:
            raise TrainingDiverged(
                f"loss or gradients held inf/NaN {self.nonfinite_in_a_row} steps in a row (more than "
                f"precision.max_nonfinite_skips={self.max_nonfinite_skips}): the run is diverging and stops; "
                "checkpoints already written are kept and finite; lower optim.lr or lengthen schedule.warmup_epochs"
            )

    def _gradients_to_master(self) -> None:
        with torch.no_grad():
            for work, master in self.pairs:
                if work.grad is None:
                    continue
                if master.grad is None:
                    master.grad = work.grad.float()
                else:  # e.g. the flat optimizer's gradient views: fill them in place
                    master.grad.copy_(work.grad)
                work.grad = None

    @contextlib.contextmanager
    def full_precision(self, optimizer: torch.optim.Optimizer, step: bool = False):
        """pure mode: inside, the optimizer's parameters are fp32; other modes: nothing happens.

        Checkpoint saves and loads run in here, so they write and read fp32 weights (the low-dtype weights upcast
        exactly) and allocate fp32 optimizer state; on exit whatever the parameters hold is rounded back into
        their low-dtype storage (views into it, such as a flat buffer's members, stay valid). With `step` the
        parameters are `weight + compensation` and the gradients are fp32 too: the optimizer steps in fp32, and
        what rounding the result drops becomes the new compensation.
        """
        if self.mode != "pure":
            yield
            return
        compensate = step and self.compensated
        params = [p for group in optimizer.param_groups for p in group["params"]]
        low, low_grads = [p.data for p in params], [p.grad for p in params]
        with torch.no_grad():
            for p in params:
                exact = p.data.float()
                if compensate:
                    exact += self._compensation(p)
                _repoint(p, exact)
                if step and p.grad is not None:
                    p.grad = p.grad.float()
        try:
            yield
        finally:
            with torch.no_grad():
                for p, weight, grad in zip(params, low, low_grads, strict=True):
                    exact = p.data
                    weight.copy_(exact)  # round to nearest
                    if compensate:
                        self._compensation(p).copy_(exact.sub_(weight))
                    _repoint(p, weight)
                    p.grad = grad
            if not self.compensated:  # the uncompensated optimizer keeps its state in the low dtype
                for state in optimizer.state.values():
                    for key, value in state.items():
                        if torch.is_tensor(value) and value.ndim and value.is_floating_point():
                            state[key] = value.to(self.dtype)

    def compensation_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        """The compensation terms by parameter name, as views that a checkpoint load fills in place."""
        names = {p: n for n, p in model.named_parameters()}
        state = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                comp = self._compensation(p)
                for member, offset in getattr(p, "members", [(p, 0)]):
                    state[names[member]] = comp[offset : offset + member.numel()].view_as(member)
        return state

    def _compensation(self, param: nn.Parameter) -> torch.Tensor:
        if param not in self.compensation:
            self.compensation[param] = torch.zeros_like(param, dtype=self.dtype)
        return self.compensation[param]

    # ------------------------------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        scaler = self.scaler.state_dict() if self.scaler is not None else None
        return {
            "mode": self.mode,
            "scaler": scaler,
            "compensated": self.compensated,
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
            "nonfinite_skipped": self.nonfinite_skipped,
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore the loss scale and refresh the working copy from the (just loaded) master weights."""
        if state and state.get("scaler") and self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        if state:
            self.nonfinite_in_a_row = state.get("nonfinite_in_a_row", 0)
            self.nonfinite_skipped = state.get("nonfinite_skipped", 0)
        self.sync_working_copy()

    def describe(self) -> str:
        scaling = f", dynamic loss scaling from {self.scaler.scale:g}" if self.scaler is not None else ""
        compensation = ", Kahan-compensated updates" if self.compensated else ""
        return f"precision {self.resolved.label}{scaling}{compensation} ({self.resolved.reason})"


def any_rank(flag: torch.Tensor) -> bool:
    """Whether a boolean tensor is true on any process (one all-reduce), so that every rank skips a step together."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_world_size() > 1:
            flag = flag.detach().to(torch.int32)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


def _working_copy(
    model: nn.Module, dtype: torch.dtype, fp32_modules: tuple[str, ...] = (), compile_norms: bool = False
) -> tuple[nn.Module, list[tuple[nn.Parameter, nn.Parameter]]]:
    """amp_o2's low-dtype copy of `model` and its (working, master) parameter pairs.

    Norm layers (and the classes named in precision.fp32_modules, with everything inside them) are not copied: the
    copy shares the master's fp32 parameters and running statistics and runs them in fp32 (inputs upcast on entry,
    outputs cast back to `dtype`); with `compile_norms`, a plain LayerNorm does the three as one compiled kernel.
    """
    working = copy.deepcopy(model)
    pairs = []
    tops = [m for m in model.modules() if keeps_fp32(m, fp32_modules)]
    inner = inside_kept(tops)
    kept = inner | {id(top) for top in tops}
    for work_mod, master_mod in zip(working.modules(), model.modules(), strict=True):
        if id(master_mod) in kept:
            for name, param in master_mod.named_parameters(recurse=False):
                setattr(work_mod, name, param)
            for name, buf in master_mod.named_buffers(recurse=False):
                work_mod._buffers[name] = buf
            if id(master_mod) in inner:
                continue
            fp32_between(work_mod, dtype, compile_norms)  # the top of a kept subtree
            continue
        for name, param in list(work_mod.named_parameters(recurse=False)):
            low = nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)
            setattr(work_mod, name, low)
            pairs.append((low, getattr(master_mod, name)))
        for name, buf in list(work_mod.named_buffers(recurse=False)):
            if buf.is_floating_point():
                work_mod._buffers[name] = buf.to(dtype)
    return working, pairs


def _compute_in_fp32(norm: nn.Module) -> None:
    """pure mode: `norm` keeps its weights in the low dtype but runs in fp32 (its running statistics are fp32).

    A bf16 LayerNorm backward sums its weight and bias gradients over every token in bf16: on the digits ViT they
    come out 13-20% off the fp32 ones (every other gradient within 2%). Here the input and the weights are
    upcast for the call (the casts are differentiable, so the gradients reach the low-dtype weights summed in fp32)
    and the output is cast back.
    """
    for name, buf in norm.named_buffers(recurse=False):
        if buf.is_floating_point():
            norm._buffers[name] = buf.float()
    plain_forward = norm.forward
    inside = False

    def forward(x: torch.Tensor) -> torch.Tensor:
        nonlocal inside
        if inside:  # the call below, with the fp32 weights swapped in
            return plain_forward(x)
        inside = True
        try:
            fp32 = {name: p.float() for name, p in norm.named_parameters(recurse=False)}
            return torch.func.functional_call(norm, fp32, (x.float(),)).to(x.dtype)
        finally:
            inside = False

    norm.forward = forward


def _repoint(param: nn.Parameter, data: torch.Tensor) -> None:
    """Make `param` (and, for a flat optimizer's buffer, each member parameter's view of it) use `data`."""
    param.data = data
    for member, offset in getattr(param, "members", ()):
        member.data = data[offset : offset + member.numel()].view_as(member)


def check_finite(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Refuse to keep weights or optimizer state that hold inf/NaN (each rank checks its own shard)."""
    tensors = list(model.state_dict().items())
    if optimizer is not None:
        local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard's state inside
        tensors += [(f"optimizer state {key}", v) for s in local.state.values() for key, v in s.items()]
    for key, tensor in tensors:
        if not torch.is_tensor(tensor):
            continue
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if local.is_floating_point() and not bool(torch.isfinite(local).all()):
            raise TrainingDiverged(
                f"{key} holds inf/NaN: training diverged, so it is not saved (the last good checkpoint "
                "is kept); lower optim.lr or use precision.mode=fp32"
            )


def check(cfg: Config) -> None:
    """The precision section (and which strategies a mode runs under): one line naming the value and the fix."""
    p = cfg.precision
    if p.fp32_modules and p.mode == "pure":
        raise ConfigError(
            f"precision.fp32_modules={list(p.fp32_modules)} keeps layers in fp32 under amp_o2; precision.mode=pure "
            "casts every weight (norms compute in fp32 already): use precision.mode=amp_o2 or drop fp32_modules"
        )
    if p.mode == "pure" and cfg.parallel.strategy not in ("single", "ddp"):
        raise ConfigError(
            f"precision.mode=pure steps low-precision weights in place, which parallel.strategy="
            f"{cfg.parallel.strategy} shards or broadcasts; use precision.mode=amp_o2 (fp32 master weights, "
            "sharded with the optimizer state) or parallel.strategy=ddp"
        )
    if p.compile_norms is True and p.mode in ("auto", "amp_o2") and cfg.train.engine == "native":
        problem = compile_norms_problem(resolve_device(cfg.train.device))
        if problem is not None:
            raise ConfigError(f"precision.compile_norms=true needs {problem}; install it or set it to false")
    if p.init_scale < p.min_scale or p.min_scale <= 0:
        raise ConfigError(f"precision.init_scale={p.init_scale} must be >= precision.min_scale={p.min_scale} > 0")
    if p.growth_interval <= 0 or p.max_overflows_at_min <= 0:
        raise ConfigError("precision.growth_interval and precision.max_overflows_at_min must be positive")
    if p.max_nonfinite_skips < 0:
        raise ConfigError(f"precision.max_nonfinite_skips={p.max_nonfinite_skips} must be >= 0 (0: stop at the first)")
