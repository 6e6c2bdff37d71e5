"""The DeepSpeed engine (`train.engine=deepspeed`): vitrain's config as a DeepSpeed ZeRO config, vitrain's optimizer.

    parallel.strategy  ddp -> ZeRO stage 0, zero1 -> 1, zero2 -> 2, zero3 -> 3
    parallel.offload   optimizer -> zero_optimization.offload_optimizer (cpu); params -> offload_param (cpu, zero3)
    precision          fp32 -> fp32; amp_o2 bf16 -> bf16; amp_o2 fp16 -> fp16 with dynamic loss scaling from
                       precision.init_scale / growth_interval / min_scale; amp_o2's precision.reduce_dtype ->
                       communication_data_type (DeepSpeed's own default is the low dtype); amp_o1 bf16 -> fp32
                       weights under torch.autocast; auto -> what vitrain's policy resolves to on this device
    train              batch_size -> train_micro_batch_size_per_gpu; accum_steps -> gradient_accumulation_steps
    optim              clip_grad_norm -> gradient_clipping, always written (DeepSpeed's code defaults to 0, its
                       docs to 1.0); vitrain's own optimizer (optim.name, its parameter groups) is passed in

A user's DeepSpeed JSON (`train.deepspeed_config=FILE`) is the base instead: its `"auto"` values are filled from
the mapping above (as Hugging Face Accelerate fills them), a concrete value of a mapped key that disagrees with
vitrain's config is a ConfigError naming both, and the keys vitrain does not map (overlap_comm, bucket sizes, the
user's own offload settings) pass through to DeepSpeed as written.

The learning rate of every step comes from vitrain's schedule (the trainer sets it, as under the native engine),
so DeepSpeed's scheduler slot stays empty and a resume continues the schedule from the step number.

The face task's identity head (vitrain/parallel/identity_head.py: fp32, this rank's rows) lives outside DeepSpeed:
DeepSpeed's backward reaches it through the loss, DeepSpeed steps the backbone, then the head's own torch optimizer
steps it (not clipped: the clipping norm is the backbone's, as under the native engine), and its rows and optimizer
state go into the step folder as DCP shards that reshard to any world size. Under fp16 DeepSpeed would scale the
head's gradients by its loss scale and check only the backbone's for overflow, so fp16 with a head is refused.

Runs on CPU with gloo (DeepSpeed's CPU accelerator) under torchrun, in the process group vitrain opened.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import pickle
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vitrain import checkpoint as ckpt
from vitrain.config import Config
from vitrain.device import PhaseTimer
from vitrain.engine.protocol import HEAD, LossFn, forward_then_backward
from vitrain.errors import CheckpointError, ConfigError
from vitrain.models import count_parameters
from vitrain.models.kernels import cpu_kernels
from vitrain.optim import GROUPED_BY, build_head_optimizer, build_optimizer, set_lr
from vitrain.parallel.distributed import DistInfo, all_or_none, rank
from vitrain.parallel.identity_head import average_replicated_gradients
from vitrain.parallel.pipeline import Pipeline
from vitrain.parallel.strategies import prepare_layers
from vitrain.precision import (
    LowPrecisionIO,
    Resolved,
    TrainingDiverged,
    any_rank,
    batch_norms_in_fp32,
    check_finite,
    plain_batch_norms,
    resolve,
)
from vitrain.weights import without_protocol_note

ZERO_STAGES = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}
DEEPSPEED_DIR = ckpt.DEEPSPEED_DIR  # DeepSpeed's own files inside a vitrain step folder (its checkpoint "tag")
UNIVERSAL_DIR = "deepspeed_universal"  # DeepSpeed's universal checkpoint of a step folder, made to change world size
RNG_FILE = "rng_rank{rank}.pt"  # each rank's RNG state (tensors only, read with weights_only=True)


def import_deepspeed() -> Any:
    """DeepSpeed on this machine's accelerator (the CPU one without CUDA), or a ConfigError saying how to get it."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # else DeepSpeed probes for one and warns
    try:
        import deepspeed
    except ImportError as error:
        raise ConfigError(
            f"train.engine=deepspeed needs DeepSpeed ({error}); pip install 'vitrain[deepspeed]' or use "
            "train.engine=native"
        ) from None
    return deepspeed


def _skip_inference_comm_op(deepspeed: Any) -> None:
    """DeepSpeed's CPU communication backend compiles a C++ shared-memory op (`deepspeed_shm_comm`) when it starts,
    35-50 s on 2 cores and again whenever another environment compiled it last, for `inference_all_reduce`, which
    only its inference tensor parallelism calls; ZeRO training never does. Marked incompatible (for the rest of the
    process), the backend starts without it and training's collectives are torch.distributed's, as they were."""
    if torch.cuda.is_available():
        return
    ops = getattr(deepspeed.ops, "__compatible_ops__", None)  # DeepSpeed probes every op here on first access
    if isinstance(ops, dict):
        ops["deepspeed_shm_comm"] = False


def _local_rank_for_deepspeed(dist: DistInfo) -> dict[str, str]:
    """deepspeed.initialize asserts that LOCAL_RANK is set, as torchrun and DeepSpeed's launcher set it. One process
    without a launcher (`python -m vitrain train ... train.engine=deepspeed`) runs in the one-process group vitrain
    opened, with LOCAL_RANK=0 as torchrun would set it; more processes without it are refused in one line. Returns
    what to set (nothing where a launcher set it); the engine sets it just before deepspeed.initialize."""
    if "LOCAL_RANK" in os.environ or "OMPI_COMM_WORLD_LOCAL_RANK" in os.environ:
        return {}
    if dist.world_size > 1:
        raise ConfigError(
            f"train.engine=deepspeed on {dist.world_size} processes needs LOCAL_RANK in each one's environment, which "
            "this launch did not set: launch with torchrun --nproc_per_node N (or DeepSpeed's launcher)"
        )
    return {"LOCAL_RANK": str(dist.local_rank)}


def resolve_precision(cfg: Config, device: torch.device) -> Resolved:
    """vitrain's precision for DeepSpeed: auto resolved as the native policy would; pure and fp16 O1 refused."""
    resolved = resolve(cfg.precision, device, cfg.parallel.strategy)
    if resolved.mode == "pure":
        raise ConfigError(
            "precision.mode=pure has no DeepSpeed counterpart (its bf16/fp16 keep fp32 master weights); use "
            "precision.mode=amp_o2 with train.engine=deepspeed"
        )
    if resolved.mode == "amp_o1" and resolved.dtype == torch.float16:
        raise ConfigError(
            "precision.mode=amp_o1 precision.dtype=fp16 under train.engine=deepspeed would have no loss scaling; use "
            "precision.mode=amp_o2 (DeepSpeed fp16 with dynamic loss scaling) or precision.dtype=bf16"
        )
    return resolved


def deepspeed_config(cfg: Config, resolved: Resolved, world_size: int = 1) -> dict[str, Any]:
    """The DeepSpeed config dict for `cfg` on `world_size` processes (see the module's docstring for each mapping),
    merged into train.deepspeed_config's file when one is given."""
    config = _mapped_config(cfg, resolved, world_size)
    if not cfg.train.deepspeed_config:
        return config
    return merge_user_config(read_deepspeed_json(cfg.train.deepspeed_config), config, cfg)


def _mapped_config(cfg: Config, resolved: Resolved, world_size: int) -> dict[str, Any]:
    p, t = cfg.parallel, cfg.train
    zero: dict[str, Any] = {"stage": ZERO_STAGES[p.strategy]}
    if p.offload == "optimizer":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    elif p.offload == "params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": t.batch_size,
        "gradient_accumulation_steps": t.accum_steps,
        "train_batch_size": t.batch_size * t.accum_steps * world_size,
        "gradient_clipping": cfg.optim.clip_grad_norm,
        "zero_optimization": zero,
        # vitrain's optimizers (torch's AdamW/SGD, its LAMB/LARS) step ZeRO's flat fp32 partitions as they are;
        # offload keeps vitrain's optimizer instead of demanding DeepSpeedCPUAdam.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**62,  # vitrain logs the steps
        "wall_clock_breakdown": False,
    }
    if resolved.mode == "amp_o2":
        # DeepSpeed averages gradients in its low dtype unless told (engine.communication_data_type); vitrain's
        # precision.reduce_dtype decides here as it does FSDP2's reduce_dtype and DDP's hook under the native engine.
        config["communication_data_type"] = cfg.precision.reduce_dtype
    if resolved.mode == "amp_o2" and resolved.dtype == torch.bfloat16:
        config["bf16"] = {"enabled": True}
    elif resolved.mode == "amp_o2":
        power = math.log2(cfg.precision.init_scale)
        if not power.is_integer():
            raise ConfigError(
                f"precision.init_scale={cfg.precision.init_scale:g} must be a power of 2 under train.engine=deepspeed "
                f"(DeepSpeed's initial_scale_power); use {2 ** round(power):g}"
            )
        config["fp16"] = {
            "enabled": True,
            "loss_scale": 0,  # 0: dynamic
            "initial_scale_power": int(power),
            "loss_scale_window": cfg.precision.growth_interval,
            "min_loss_scale": cfg.precision.min_scale,
            "hysteresis": 1,  # halve at every overflow, as vitrain's LossScaler does
        }
    return config


def _precision(cfg: Config, value: Any) -> str:
    return f"precision.mode={cfg.precision.mode} precision.dtype={cfg.precision.dtype} gives {json.dumps(value)}"


def _optimizer(cfg: Config, value: Any) -> str:
    return f"vitrain passes its own optimizer (optim.name={cfg.optim.name}), which needs {json.dumps(value)}"


# The keys of a user's DeepSpeed JSON that vitrain's config decides, each with what decides it (for the error): a
# missing or "auto" value is filled, a different one refused. Other keys vitrain writes (steps_per_print,
# wall_clock_breakdown, pin_memory) are only its defaults: the file's values win.
MAPPED: dict[str, Callable[[Config, Any], str]] = {
    "train_micro_batch_size_per_gpu": lambda c, v: f"train.batch_size={c.train.batch_size}",
    "gradient_accumulation_steps": lambda c, v: f"train.accum_steps={c.train.accum_steps}",
    "train_batch_size": lambda c, v: (
        f"train.batch_size={c.train.batch_size} x train.accum_steps={c.train.accum_steps} x processes = {v}"
    ),
    "gradient_clipping": lambda c, v: f"optim.clip_grad_norm={c.optim.clip_grad_norm:g}",
    "zero_optimization.stage": lambda c, v: f"parallel.strategy={c.parallel.strategy} (stage {v})",
    "zero_optimization.offload_optimizer.device": lambda c, v: f"parallel.offload={c.parallel.offload}",
    "zero_optimization.offload_param.device": lambda c, v: f"parallel.offload={c.parallel.offload}",
    "communication_data_type": lambda c, v: f"precision.reduce_dtype={c.precision.reduce_dtype}",
    "bf16.enabled": _precision,
    "fp16.enabled": _precision,
    "fp16.loss_scale": lambda c, v: "vitrain's fp16 uses dynamic loss scaling (0)",
    "fp16.initial_scale_power": lambda c, v: f"precision.init_scale={c.precision.init_scale:g} (2^{v})",
    "fp16.loss_scale_window": lambda c, v: f"precision.growth_interval={c.precision.growth_interval}",
    "fp16.min_loss_scale": lambda c, v: f"precision.min_scale={c.precision.min_scale:g}",
    "fp16.hysteresis": lambda c, v: "vitrain's loss scaling halves at every overflow (1)",
    "zero_allow_untested_optimizer": _optimizer,
    "zero_force_ds_cpu_optimizer": _optimizer,
}
# Sections DeepSpeed would build instead of vitrain's optimizer and schedule.
OWNED_SECTIONS = {"optimizer": "optim.*", "scheduler": "schedule.*"}


def merge_user_config(user: dict[str, Any], ours: dict[str, Any], cfg: Config) -> dict[str, Any]:
    """`ours` (vitrain's mapping) merged into the user's DeepSpeed JSON: "auto" and missing mapped values filled,
    disagreements refused naming both values, every key vitrain does not map kept as the user wrote it."""
    name = f"train.deepspeed_config={cfg.train.deepspeed_config}"
    for section, fields in OWNED_SECTIONS.items():
        if section in user:
            raise ConfigError(
                f'{name} has an "{section}" section, but vitrain passes its own ({fields}); remove the section'
            )
    ours = copy.deepcopy(ours)
    for low in ("bf16", "fp16"):  # an "auto" or explicit switch in the file is compared with vitrain's precision
        ours.setdefault(low, {"enabled": False})
    merged = copy.deepcopy(user)
    _merge_into(merged, ours, cfg, name, prefix="")
    leftover = _auto_keys(merged)
    if leftover:
        raise ConfigError(
            f'{name}: {leftover[0]}="auto" is not a value vitrain fills (it fills {", ".join(sorted(MAPPED))}); '
            "give a value or remove the key"
        )
    return merged


def _merge_into(theirs: dict[str, Any], ours: dict[str, Any], cfg: Config, name: str, prefix: str) -> None:
    for key, value in ours.items():
        dotted = prefix + key
        if isinstance(value, dict):
            section = theirs.setdefault(key, {})
            if section == "auto":
                section = theirs[key] = {}
            if not isinstance(section, dict):
                raise ConfigError(f"{name}: {dotted} must be a JSON object, not {json.dumps(section)}; fix the file")
            _merge_into(section, value, cfg, name, prefix=dotted + ".")
        elif key not in theirs or theirs[key] == "auto":
            theirs[key] = value
        elif dotted in MAPPED and not _same(theirs[key], value):
            raise ConfigError(
                f"deepspeed_config {dotted}={json.dumps(theirs[key])} but {MAPPED[dotted](cfg, value)}; set one of "
                'them to match or "auto"'
            )


def _same(a: Any, b: Any) -> bool:
    """JSON equality: true is not 1, 2 is 2.0."""
    return isinstance(a, bool) == isinstance(b, bool) and a == b


def _auto_keys(config: dict[str, Any], prefix: str = "") -> list[str]:
    found = []
    for key, value in config.items():
        if value == "auto":
            found.append(prefix + key)
        elif isinstance(value, dict):
            found += _auto_keys(value, prefix + key + ".")
    return found


class DeepSpeedEngine:
    """vitrain's model and optimizer inside `deepspeed.initialize`; backward, step and checkpoints are DeepSpeed's."""

    name = "deepspeed"

    def __init__(
        self,
        cfg: Config,
        model: nn.Module,
        dist: DistInfo,
        head: nn.Module | None = None,
        pipeline: Pipeline | None = None,
        precision: Resolved | None = None,
    ):
        # precision: autotune's decision is the native engine's (auto resolves by the policy's rules here).
        # config.validate refuses these combinations first; the engine repeats it for callers that skip validation.
        if pipeline is not None:
            raise ConfigError("train.engine=deepspeed does not run pipeline stages; use train.engine=native")
        deepspeed = import_deepspeed()
        launcher_env = _local_rank_for_deepspeed(dist)  # a launch without LOCAL_RANK is refused before the build
        self.cfg, self.dist = cfg, dist
        self.resolved = resolve_precision(cfg, dist.device)
        if head is not None and self.resolved.mode == "amp_o2" and self.resolved.dtype == torch.float16:
            raise ConfigError(
                "task.name=face with precision amp_o2 fp16 under train.engine=deepspeed: DeepSpeed's loss scale would "
                "reach the identity head's gradients unchecked; use precision.dtype=bf16, precision.mode=fp32, or "
                "train.engine=native"
            )
        self.config = deepspeed_config(cfg, self.resolved, dist.world_size)
        self.stage = self.config["zero_optimization"]["stage"]
        from deepspeed.accelerator import get_accelerator

        if _enabled(self.config, "fp16") and not get_accelerator().is_fp16_supported():
            # DeepSpeed's own refusal is a ValueError from deep inside initialize ("Type fp16 is not supported").
            raise ConfigError(
                f"precision.dtype=fp16 under train.engine=deepspeed: DeepSpeed's {get_accelerator().device_name()} "
                "accelerator trains no fp16; use precision.dtype=bf16, precision.mode=fp32, or train.engine=native"
            )
        # Activation checkpointing and cross-rank BatchNorm (the face neck's), as the native strategies apply them.
        cpu_kernels(model, cfg, dist.device)
        prepare_layers(model, cfg.parallel, dist.device)
        # "ddp": any distributed strategy gets per-tensor kernels (fused), never the flat buffer of one process.
        optimizer = build_optimizer(model, cfg.optim, dist.device, strategy="ddp")
        self.groups = group_names(model, optimizer)  # DeepSpeed keeps its state by group: saved to tell a change
        self.torch_optimizer = optimizer  # the one DeepSpeed's optimizer steps (its .optimizer under ZeRO)
        self.parameters = count_parameters(model)  # before ZeRO-3 partitions the parameters
        # DeepSpeed's ZeRO collectives call these deprecated torch functions: DeepSpeed's to change, not the user's.
        # Filtered for the whole process, as DeepSpeed calls them from its hooks on every step; shown once they would
        # not stay once, since DeepSpeed's per-step numactl subprocess enters warnings.catch_warnings, which resets
        # the shown-once registry (a line per rank per step under ZeRO-3).
        warnings.filterwarnings(
            "ignore",
            message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
            category=FutureWarning,
            module=r"torch\.distributed\.",
        )
        # The launcher's variables vitrain sets for DeepSpeed stay set until close(), as DeepSpeed reads them all run
        # (LOCAL_RANK at ZeRO-3's parameter checks and universal checkpoints, LOCAL_SIZE at every ZeRO-3 gradient
        # reduction); close() takes them away, so that a later run in this process (vitrain.train in a notebook)
        # does not look launched by torchrun.
        self.env_set: list[str] = []
        try:
            batch_norms_in_fp32(model)  # DeepSpeed's bf16/fp16 casts their weights, not their running statistics
            self._set_env(launcher_env)
            _skip_inference_comm_op(deepspeed)
            # DeepSpeed prints what it built or probed on stdout, where `vitrain train` writes its JSON.
            with contextlib.redirect_stdout(io.StringIO()):
                self.ds, self.optimizer, _, _ = deepspeed.initialize(
                    model=model, optimizer=optimizer, config=self.config
                )
        except BaseException:
            self.close()  # a failed set-up leaves the environment as it found it, and the model's classes
            plain_batch_norms(model)
            raise
        if not torch.cuda.is_available() and "LOCAL_SIZE" not in os.environ:
            # DeepSpeed's CPU accelerator counts a node's devices with a numactl subprocess on every call unless
            # LOCAL_SIZE gives the count (DeepSpeed's launcher sets it, torchrun does not), and ZeRO-3 asks on every
            # gradient reduction. Set only after initialize: a LOCAL_SIZE equal to the world size when DeepSpeed's
            # communication starts would make its shm op, were it built (`_skip_inference_comm_op`), map a 66 MB
            # /dev/shm segment per rank, never unlinked, for an inference all-reduce vitrain does not use.
            self._set_env({"LOCAL_SIZE": os.environ.get("LOCAL_WORLD_SIZE", "1")})
        self.model = model  # the ds engine's module: under ZeRO-3 its parameters are partitioned
        self.fp16 = _enabled(self.config, "fp16")
        low = self.fp16 or _enabled(self.config, "bf16")
        # DeepSpeed casts the model to its low dtype; images go in in that dtype and logits come back fp32.
        self.forward: nn.Module = LowPrecisionIO(self.ds, self.ds.get_data_types()[0]) if low else self.ds
        self.head = head
        self.head_optimizer = build_head_optimizer(head, cfg.optim, dist.device) if head is not None else None

    def _set_env(self, values: dict[str, str]) -> None:
        for name, value in values.items():
            os.environ[name] = value
            self.env_set.append(name)

    def close(self) -> None:
        """The trainer's close(), after the run's last step and save: the environment variables this engine set for
        DeepSpeed are taken away (a launcher's own are left as they were)."""
        while self.env_set:
            os.environ.pop(self.env_set.pop(), None)
        if getattr(self, "model", None) is not None:
            plain_batch_norms(self.model)

    # ------------------------------------------------------------------------------------------ step

    @staticmethod
    def check(cfg: Config) -> None:
        """What vitrain maps onto DeepSpeed and what not: one line naming the value and the fix."""
        if cfg.train.ema:
            raise ConfigError(
                "train.ema averages whole weights on every rank, which DeepSpeed shards or owns: use train.engine="
                "native (parallel.strategy single, ddp or zero1) or set train.ema=0"
            )
        if cfg.train.checkpoint_async:
            raise ConfigError(
                "train.checkpoint_async writes DCP checkpoints in the background, which DeepSpeed's own checkpoint "
                "files are not: use train.engine=native or set train.checkpoint_async=false"
            )
        if cfg.train.deepspeed_config:
            read_deepspeed_json(cfg.train.deepspeed_config)
        p, where = cfg.parallel, "under train.engine=deepspeed"
        if p.strategy == "single":
            raise ConfigError(
                f"parallel.strategy=single {where}: the strategy picks the ZeRO stage; use parallel.strategy=ddp "
                "(stage 0), zero1, zero2 or zero3"
            )
        if p.pipeline_stages > 1:
            raise ConfigError(f"parallel.pipeline_stages={p.pipeline_stages} {where} is not supported; use 1")
        if p.sharded_init:
            raise ConfigError(
                f"parallel.sharded_init=true {where} is not supported (DeepSpeed takes a built model); set "
                "parallel.sharded_init=false"
            )
        if p.offload == "params" and p.strategy != "zero3":
            raise ConfigError(
                f"parallel.offload=params {where} needs parallel.strategy=zero3 (DeepSpeed offloads parameters only "
                "under ZeRO-3); use parallel.offload=optimizer with ddp/zero1/zero2"
            )
        if cfg.task.name == "face" and cfg.precision.mode == "amp_o2" and cfg.precision.dtype == "fp16":
            raise ConfigError(
                f"task.name=face with precision.mode=amp_o2 precision.dtype=fp16 {where}: DeepSpeed's loss scale would "
                "reach the identity head's gradients unchecked; use precision.dtype=bf16, precision.mode=fp32, or "
                "train.engine=native"
            )
        if cfg.train.compile:
            raise ConfigError(f"train.compile=true {where} is not supported; set train.compile=false")
        if cfg.precision.mode == "pure":
            raise ConfigError(
                f"precision.mode=pure {where} has no DeepSpeed counterpart (its bf16/fp16 keep fp32 master weights); "
                "use precision.mode=amp_o2"
            )
        if cfg.precision.mode == "amp_o1" and cfg.precision.dtype == "fp16":
            raise ConfigError(
                f"precision.mode=amp_o1 precision.dtype=fp16 {where} would run without loss scaling; use "
                "precision.mode=amp_o2 (DeepSpeed fp16, dynamic loss scaling) or precision.dtype=bf16"
            )

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.resolved.mode != "amp_o1":
            return contextlib.nullcontext()
        return torch.autocast(self.dist.device.type, dtype=self.resolved.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        # DeepSpeed divides by gradient_accumulation_steps itself, and counts micro-steps in step(): each
        # micro-step but the last of an optimizer step calls it (it only advances the count there).
        boundary = self.ds.is_gradient_accumulation_boundary()
        self.ds.backward(loss)
        if not boundary:
            self.ds.step()

    def forward_backward(
        self, images: torch.Tensor, labels: torch.Tensor, loss_fn: LossFn, timer: PhaseTimer | None = None
    ) -> torch.Tensor:
        return forward_then_backward(self, images, labels, loss_fn, timer)

    def step(self, loss_nonfinite: torch.Tensor | None = None) -> tuple[float | None, bool]:
        # DeepSpeed skips a step only under fp16 loss scaling (inf/NaN gradients halve the scale); in fp32 and
        # bf16 it would apply a NaN step, so a non-finite loss (or head gradient) stops the run before the weights
        # change.
        if not self.fp16:
            bad = loss_nonfinite if loss_nonfinite is not None else torch.zeros((), dtype=torch.bool)
            if self.head is not None:
                average_replicated_gradients(self.head)
                grads = [p.grad for p in self.head.parameters() if p.grad is not None]
                if grads:
                    bad = bad.to(grads[0].device) | ~torch.isfinite(torch.nn.utils.get_total_norm(grads))
            if any_rank(bad.to(self.dist.device)):
                raise TrainingDiverged(
                    "the loss or the head's gradients held inf/NaN under train.engine=deepspeed, which cannot skip an "
                    "fp32/bf16 step: the run stops with its last good checkpoint; lower optim.lr or use "
                    "train.engine=native (it skips such steps)"
                )
        # Stage 0 keeps no norm of its own: the gradients are all-reduced by now, so every rank measures the same.
        norm = self._stage0_norm() if self.stage == 0 else None
        self.ds.step()
        applied = self.ds.was_step_applied()
        if self.head_optimizer is not None:  # after DeepSpeed's step, and only when DeepSpeed applied one
            if applied:
                self.head_optimizer.step()
            self.head_optimizer.zero_grad(set_to_none=True)
        if not applied:
            return None, True
        if norm is None:
            norm = self.ds.get_global_grad_norm()
        return (float(norm) if norm is not None else None), False

    def _stage0_norm(self) -> float | None:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads)) if grads else None

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)  # ZeRO's optimizers show the inner groups, "lr_scale" kept
        if self.head_optimizer is not None:
            set_lr(self.head_optimizer, lr)

    def parameter_count(self) -> int:
        return self.parameters

    # ------------------------------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {
            "mode": self.resolved.mode,
            "zero_stage": self.stage,
            "deepspeed_config": self.config,
            "param_groups": self.groups,
        }

    def save(self, run_dir: Path, step: int, meta: dict[str, Any], keep: int) -> Path:
        if self.head is not None:  # a diverged head keeps the last good checkpoint instead of saving inf/NaN
            with all_or_none("checking the head before a checkpoint"):
                check_finite(self.head, self.head_optimizer)

        def write(folder: Path) -> None:
            # DeepSpeed writes its model and (per rank) optimizer partitions under folder/deepspeed/.
            self.ds.save_checkpoint(str(folder), tag=DEEPSPEED_DIR, save_latest=False)
            torch.save(ckpt.rng_state(), folder / RNG_FILE.format(rank=rank()))
            if self.head is not None:  # DCP shards by identity row beside DeepSpeed's folder: any world size
                ckpt.save_extra(folder, {HEAD: self.head.checkpoint_state(self.head_optimizer)})

        return ckpt.save_folder(run_dir, step, meta, keep, write)

    def wait_for_save(self) -> Path | None:
        return None  # DeepSpeed's saves are synchronous (check() refuses train.checkpoint_async)

    def load(self, path: Path, meta: dict[str, Any]) -> bool:
        saved_ranks = meta.get("world_size", 1)
        with all_or_none(f"reading checkpoint {path}"):
            if not (Path(path) / DEEPSPEED_DIR).is_dir():
                raise CheckpointError(f"checkpoint {path} holds no {DEEPSPEED_DIR}/ folder of DeepSpeed's files")
            refuse_code(Path(path) / DEEPSPEED_DIR)
            saved_stage = ZERO_STAGES.get(meta.get("strategy"), 0)
            if saved_stage != self.stage:
                raise CheckpointError(
                    f"checkpoint {path} was saved under ZeRO stage {saved_stage} (parallel.strategy="
                    f"{meta.get('strategy')}); resume with the same parallel.strategy"
                )
            # ZeRO 1-3 keep one flat optimizer partition per rank and parameter group, in files named by the weights'
            # dtype, which DeepSpeed reads only on as many ranks, into the same groups, in the same dtype: on another
            # count, after the groups changed (optim.weight_decay to or from 0, optim.layer_decay, the grouping rule)
            # or between fp32 and bf16 weights (precision.mode=auto resolving otherwise on another machine), the step
            # folder is converted once into DeepSpeed's universal checkpoint (whole fp32 tensors per parameter),
            # which any count, grouping and dtype loads.
            saved_dtype = self._retyped(path, meta)
            regrouped = self._regrouped(path, meta)
            # What gives the saved layout back, for a folder DeepSpeed's converter cannot convert.
            same = [f"on {saved_ranks} processes"] if saved_ranks != self.dist.world_size else []
            same += ["with the optim.* values it was saved with"] if regrouped else []
            same += [f"with {_PRECISION_OF[saved_dtype]}"] if saved_dtype else []
            reshard = bool(same) and self.stage > 0
            if reshard and rank() == 0:
                universal_checkpoint(Path(path), fix="resume " + " and ".join(same))
        load_dir = Path(path)
        if reshard:
            load_dir = Path(path) / UNIVERSAL_DIR
            with all_or_none(f"reading the universal checkpoint {load_dir}"):
                refuse_code(load_dir / DEEPSPEED_DIR)
        previous = self.ds._config.load_universal_checkpoint
        self.ds._config.load_universal_checkpoint = reshard  # DeepSpeed reads the switch at load time only
        # DeepSpeed's load puts the saved groups' values back (weight decay, betas, eps, layer decay's lr_scale): the
        # run's own, from the optim.* it resumes with, are kept, as under the native engine; only the state is read.
        own = [{key: value for key, value in group.items() if key != "params"} for group in self.optimizer.param_groups]
        try:
            self.ds.load_checkpoint(str(load_dir), tag=DEEPSPEED_DIR, load_lr_scheduler_states=False)
        finally:
            self.ds._config.load_universal_checkpoint = previous
        own_steps(self.torch_optimizer)
        if reshard:
            self._load_outside_groups(Path(path), meta)
        for group, values in zip(self.optimizer.param_groups, own, strict=True):
            group.update(values)
        if self.head is not None:
            self.head.load_checkpoint(path, self.head_optimizer)
        rng_file = Path(path) / RNG_FILE.format(rank=rank())
        with all_or_none(f"reading checkpoint {path}"):  # a rank that refuses its file stops them all, in one line
            state = ckpt.read_rng_file(rng_file) if rng_file.is_file() else None
        if state is None:
            return False
        ckpt.set_rng_state(state)
        return True

    def _load_outside_groups(self, path: Path, meta: dict[str, Any]) -> None:
        """What DeepSpeed's universal load leaves as the run built it: the buffers (BatchNorm's running statistics,
        the conv stem's and the face neck's) and the parameters outside the optimizer's groups (frozen, also those
        frozen on resume). It reads only each trained parameter's `zero/<name>/` files and skips the module's states
        file; these come from the step folder's own files instead (DeepSpeed's zero_to_fp32, as `vitrain export`)."""
        trained = {name for group in self.groups for name in group}
        module = self.ds.module
        params, buffers = dict(module.named_parameters()), dict(module.named_buffers())
        rest = {name: t for name, t in consolidated_state_dict(path, meta).items() if name not in trained}
        frozen = [params[name] for name in rest if name in params]
        gathered = contextlib.nullcontext()
        if self.stage == 3 and frozen:  # partitioned like the rest: whole while written, then partitioned again
            import deepspeed

            gathered = deepspeed.zero.GatheredParameters(frozen, modifier_rank=0)
        with torch.no_grad(), gathered:
            for name, value in rest.items():
                target = params[name] if name in params else buffers.get(name)
                if target is not None:
                    target.copy_(value.to(target.dtype))

    def _retyped(self, path: Path, meta: dict[str, Any]) -> str | None:
        """The checkpoint's weights dtype (fp32, bf16, fp16) where it differs from this run's and the universal
        checkpoint loads it, else None; refused in one line where it cannot: stage 0 keeps another optimizer's state
        per dtype (torch's, or DeepSpeed's bf16 or fp16 one), and fp16's loss scale state is not carried across
        (untested here: DeepSpeed runs no fp16 on a CPU)."""
        saved_config = (meta.get("precision") or {}).get("deepspeed_config")
        if saved_config is None:
            return None
        saved, now = _weights_dtype(saved_config), _weights_dtype(self.config)
        if saved == now:
            return None
        if self.stage == 0 or "fp16" in (saved, now):
            raise CheckpointError(
                f"checkpoint {path} holds DeepSpeed's state of {saved} weights and this run trains {now} ones "
                f"(precision.mode={self.cfg.precision.mode} resolves to {self.resolved.mode}); DeepSpeed cannot load "
                f"one into the other under parallel.strategy={self.cfg.parallel.strategy}: resume with "
                f"{_PRECISION_OF[saved]}"
            )
        return saved

    def _regrouped(self, path: Path, meta: dict[str, Any]) -> bool:
        """Whether the checkpoint's parameter groups differ from this run's, where DeepSpeed's universal checkpoint
        loads them parameter by parameter (unknown for checkpoints written before vitrain kept them: taken as the
        same). A parameter no longer trained (frozen on resume) leaves its state behind, as under the native engine.
        Refused in one line where it cannot load: a parameter the checkpoint holds no state for (a user's own model),
        by name; stage 0, which keeps torch's optimizer state indexed by position in its groups; stages 1-2 with more
        groups than saved (DeepSpeed 0.19's loader pairs them by index, so the extra ones would start without state).
        runs.restore names the optim.* values changed that decide the grouping."""
        saved = (meta.get("precision") or {}).get("param_groups")
        if saved is None or saved == self.groups:
            return False
        saved_names = [name for group in saved for name in group]
        names = [name for group in self.groups for name in group]
        gone, new = set(saved_names) - set(names), set(names) - set(saved_names)
        if new or (gone and self.stage == 0):
            if new:
                first = next(name for name in names if name in new)
                what = f"this run's model trains {first}, which it holds no state for ({len(new)} such)"
            else:
                first = next(name for name in saved_names if name in gone)
                what = (
                    f"it holds {first}, which this run's model does not train ({len(gone)} such), and DeepSpeed loads "
                    "stage 0's state by position"
                )
            raise CheckpointError(
                f"checkpoint {path} holds DeepSpeed's optimizer state for other parameters than this run trains: "
                f"{what}; resume with the model it was saved with"
            )
        if self.stage == 0 or (self.stage < 3 and len(self.groups) > len(saved)):
            how = "by position in its groups" if self.stage == 0 else "into at most as many groups as it saved"
            raise ckpt.StateMismatch(
                f"checkpoint {path} holds DeepSpeed's optimizer state in {len(saved)} parameter groups and this run "
                f"has {len(self.groups)}: DeepSpeed loads it {how} under parallel.strategy={self.cfg.parallel.strategy}"
                "; resume with the optim.* values, model and vitrain version it was saved with, or start a new run "
                "from its weights (`vitrain export`, then model.init_from=)",
                shaped_by=GROUPED_BY,
            )
        return True

    @staticmethod
    def load_weights(path: Path, meta: dict[str, Any], model: nn.Module) -> None:
        """A DeepSpeed step folder's fp32 weights into a single-device `model`, in one process."""
        model.load_state_dict(consolidated_state_dict(path, meta))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Under bf16/fp16 these are the weights the model computes with, upcast (the fp32 masters live in
        DeepSpeed's optimizer partitions; `vitrain export` reads those from a checkpoint)."""
        params = list(self.model.parameters())
        gathered = contextlib.nullcontext()
        if self.stage == 3:
            import deepspeed

            gathered = deepspeed.zero.GatheredParameters(params, modifier_rank=None)
        with gathered:
            return {name: t.detach().float().cpu().clone() for name, t in self.model.state_dict().items()}

    def scaler_fields(self) -> dict[str, Any]:
        if not self.fp16:
            return {}
        return {"loss_scale": float(self.optimizer.cur_scale), "skipped_steps": int(self.ds.skipped_steps)}

    def skip_report(self) -> tuple[dict[str, Any], str | None]:
        return self.scaler_fields(), None

    @property
    def precision_label(self) -> str:
        return self.resolved.label

    def describe(self) -> list[str]:
        zero = self.config["zero_optimization"]
        offload = ", ".join(k for k in ("offload_optimizer", "offload_param") if k in zero) or "no offload"
        low = (
            "bf16" if _enabled(self.config, "bf16") else "fp16 (dynamic loss scaling)" if self.fp16 else "fp32 weights"
        )
        return [
            f"engine deepspeed {_version()}: ZeRO stage {self.stage} ({offload}), {low}, gradient_clipping="
            f"{self.config['gradient_clipping']:g}, gradient_accumulation_steps="
            f"{self.config['gradient_accumulation_steps']}",
            f"precision {self.resolved.label} ({self.resolved.reason})",
        ]


def _enabled(config: dict[str, Any], section: str) -> bool:
    return bool(config.get(section, {}).get("enabled"))


def _weights_dtype(config: dict[str, Any]) -> str:
    """The dtype DeepSpeed keeps the model's weights in under `config` (and names its optimizer files by)."""
    return "bf16" if _enabled(config, "bf16") else "fp16" if _enabled(config, "fp16") else "fp32"


# What gives each weights dtype back on resume (amp_o1 bf16 trains fp32 weights as well).
_PRECISION_OF = {
    "fp32": "precision.mode=fp32",
    "bf16": "precision.mode=amp_o2 precision.dtype=bf16",
    "fp16": "precision.mode=amp_o2 precision.dtype=fp16",
}


def _version() -> str:
    import deepspeed

    return deepspeed.__version__


def consolidated_state_dict(path: Path, meta: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A DeepSpeed step folder's fp32 weights under single-device names (one process, no process group).

    ZeRO 1-3: DeepSpeed's zero_to_fp32 merges every rank's fp32 master partitions; stage 0: the model states file
    (exact in fp32; under bf16/fp16 the low-dtype weights, upcast). Non-finite values are refused by name. These
    files are DeepSpeed's pickles: `refuse_code` reads each one safely first.
    """
    import_deepspeed()
    folder = Path(path) / DEEPSPEED_DIR
    refuse_code(folder)
    stage = ZERO_STAGES.get(meta.get("strategy"), 0)
    if stage == 0:
        state = torch.load(folder / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True)["module"]
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        # DeepSpeed's converter prints its progress (on stdout, where `vitrain eval` writes its JSON) and tqdm bars:
        # not vitrain's log, but what it got through tells where a failed conversion stopped.
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
                state = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=DEEPSPEED_DIR)
        except Exception:
            sys.stderr.write(printed.getvalue())
            raise
    weights = {}
    for name, tensor in state.items():
        tensor = tensor.detach().to("cpu", torch.float32)
        if not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"checkpoint {path}: {name} holds inf/NaN; export an earlier checkpoint")
        weights[name] = tensor.contiguous()
    return weights


def own_steps(optimizer: torch.optim.Optimizer) -> int:
    """Give each optimizer state a `step` tensor of its own; returns how many were shared.

    DeepSpeed 0.19.8's ZeRO-3 universal load (another world size, grouping or weights dtype) puts one `step` tensor
    into every sub-group's state, which torch's AdamW advances in place: once per sub-group and step, so a run of two
    groups counted two steps for each one it took, and its bias correction ran ahead of the run."""
    seen: set[int] = set()
    shared = 0
    for state in optimizer.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            if id(step) in seen:
                state["step"] = step.clone()
                shared += 1
            seen.add(id(step))
    return shared


def group_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The optimizer's parameter groups as the names of their parameters, in order: how DeepSpeed lays its state."""
    names = {param: name for name, param in model.named_parameters()}
    return [[names[param] for param in group["params"]] for group in optimizer.param_groups]


def universal_checkpoint(path: Path, fix: str = "resume on the world size it was saved with") -> Path:
    """Step folder `path`'s DeepSpeed files as DeepSpeed's universal checkpoint, in `path`/deepspeed_universal/
    (tag deepspeed/ inside it, as DeepSpeed's loader expects a folder and a tag), converted on first use.

    ds_to_universal unpickles the input files without weights_only, so `refuse_code` vets them first. The conversion
    fills a temporary folder and renames it into place, so a crash leaves no half-converted folder that a later
    resume would take for a whole one. vitrain's models carry no tensor-parallel patterns, so the missing
    universal-checkpoint info is injected as DeepSpeed's converter offers (`inject_missing_state`). `fix`: what the
    line refusing a folder it cannot convert tells the user to do instead (DeepSpeed 0.19.8 converts AdamW's and
    LAMB's moments, not SGD's or LARS's momentum).
    """
    final = path / UNIVERSAL_DIR
    if final.is_dir():
        return final
    import argparse

    from deepspeed.checkpoint import ds_to_universal

    refuse_code(path / DEEPSPEED_DIR)
    tmp = path / f".tmp-{UNIVERSAL_DIR}"
    shutil.rmtree(tmp, ignore_errors=True)  # an interrupted conversion's leftovers
    args = argparse.Namespace(
        input_folder=str(path / DEEPSPEED_DIR),
        output_folder=str(tmp / DEEPSPEED_DIR),
        num_extract_workers=1,  # in this process: no process pool inside a training process
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    try:
        # Its progress prints and tqdm bars are not vitrain's log.
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            ds_to_universal.main(args)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        raise CheckpointError(
            f"checkpoint {path}: DeepSpeed's universal checkpoint conversion (deepspeed.checkpoint.ds_to_universal) "
            f"failed ({reason}); {fix}"
        ) from None
    ckpt._fsync_tree(tmp)
    tmp.rename(final)
    ckpt.fsync_dir(path)
    return final


def refuse_code(folder: Path) -> None:
    """Read every DeepSpeed `*.pt` file under `folder` (subfolders too: a universal checkpoint keeps one folder of
    files per parameter) with torch's weights_only unpickler first, which builds tensors, plain
    data and only DeepSpeed's own plain records (its loss scalers, ZeRO stage enum and fragment addresses), and runs
    nothing; a file naming anything else is refused before DeepSpeed, which unpickles without that guard, reads it."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    allowed = [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]
    for file in sorted(folder.rglob("*.pt")):
        try:
            with torch.serialization.safe_globals(allowed), without_protocol_note():
                torch.load(file, map_location="cpu", weights_only=True)
        except Exception as exc:  # an UnpicklingError naming the global, or a damaged file
            reason = ckpt.load_error(exc)  # without torch's advice to load it with weights_only=False
            if not isinstance(exc, pickle.UnpicklingError):
                raise CheckpointError(
                    f"checkpoint file {file} cannot be read ({reason}); it is damaged or was not written by DeepSpeed"
                ) from None
            raise CheckpointError(
                f"checkpoint file {file} holds more than tensors and DeepSpeed's plain records, so vitrain does not "
                f"unpickle it ({reason}); load only checkpoints that DeepSpeed wrote"
            ) from None


def read_deepspeed_json(path: str) -> dict[str, Any]:
    """train.deepspeed_config's file as a dict (read with json, never unpickled), or a ConfigError naming the file."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(
            f"train.deepspeed_config={path} is not a file; give the path of a DeepSpeed JSON config or drop the field"
        )
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"train.deepspeed_config={path} is not valid JSON ({error}); fix the file") from None
    if not isinstance(config, dict):
        raise ConfigError(
            f"train.deepspeed_config={path} holds a JSON {type(config).__name__}, not an object; a DeepSpeed config "
            'is an object such as {"zero_optimization": {"stage": "auto"}}'
        )
    return config
