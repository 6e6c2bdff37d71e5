"""The native engine: vitrain's precision policy over a parallel strategy (or a pipeline), DCP checkpoints."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vitrain import checkpoint as ckpt
from vitrain.config import Config
from vitrain.device import PhaseTimer, key_compiled_cpu_kernels
from vitrain.engine.ema import WeightAverage
from vitrain.engine.protocol import COMPENSATION, EMA, HEAD, LossFn, forward_then_backward
from vitrain.errors import ConfigError
from vitrain.models import count_parameters, plan_of
from vitrain.models.kernels import cpu_kernels
from vitrain.optim import build_head_optimizer, set_lr
from vitrain.optim.muon import Muon
from vitrain.parallel import build_parallel_optimizer, parallelize, unwrap
from vitrain.parallel.distributed import DistInfo, all_or_none, broadcast_object, side_group
from vitrain.parallel.identity_head import average_replicated_gradients
from vitrain.parallel.overlap import deferrable
from vitrain.parallel.pipeline import Pipeline
from vitrain.parallel.strategies import finish_reductions, fully_shard_model
from vitrain.precision import PrecisionPolicy, Resolved, check_finite, compiles_norms, time_block_modes


class NativeEngine:
    """vitrain's own engine: a precision policy over a parallel strategy (or a pipeline), DCP checkpoints.

    `model` is the single-device model (its parameters sharded DTensors under zero2/zero3), which holds the fp32
    master weights under amp_o2 and is what the optimizer and checkpoints use; `forward` is the module that computes
    (amp_o2 outside zero2/zero3: a low-dtype working copy). `head` (the face task's identity head: fp32, this rank's
    rows) has its own optimizer and steps with the model, unscaled and checked with it.
    """

    name = "native"

    def __init__(
        self,
        cfg: Config,
        model: nn.Module,
        dist: DistInfo,
        head: nn.Module | None = None,
        pipeline: Pipeline | None = None,
        precision: Resolved | None = None,
    ):
        self.cfg, self.dist, self.pipeline = cfg, dist, pipeline
        device = dist.device
        cpu_kernels(model, cfg, device)  # before the policy: its probe (time_modes) times the layers that will train
        self.precision = PrecisionPolicy(
            cfg.precision,
            device,
            cfg.parallel.strategy,
            # The probe times one block of a model that knows its block's input (vitrain's ViT); others keep the rule.
            time_modes=(lambda: time_modes(cfg, model, dist)) if hasattr(model, "parallel_plan") else None,
            pipelined=pipeline is not None,
            decided=precision,
        )
        if pipeline is not None:
            strategy = pipeline.parallelize
        else:  # a deferred reduce-scatter must not meet an accumulating gradient (vitrain/parallel/overlap.py)
            strategy = functools.partial(parallelize, overlap=deferrable(cfg))
        working = self.precision.prepare(model, lambda m, mixed: strategy(m, cfg.parallel, device, mixed))
        self.model = model
        self.optimizer = build_parallel_optimizer(model, cfg.optim, cfg.parallel, device)
        if isinstance(self.optimizer, Muon):  # Newton-Schulz in bf16 where the run computes in it (autotune: fast)
            self.optimizer.ns_dtype = torch.bfloat16 if self.precision.dtype == torch.bfloat16 else torch.float32
        self.forward = working
        if cfg.train.compile:
            key_compiled_cpu_kernels(device.type)
            self.forward = torch.compile(working)
        if pipeline is not None:  # the schedule trains; evaluation runs the stages one after the other
            self.forward = pipeline
        self.head = head
        self.head_optimizer = build_head_optimizer(head, cfg.optim, device) if head is not None else None
        self.ema = WeightAverage(model, cfg.train.ema, cfg.train.ema_warmup) if cfg.train.ema else None
        self.pending: ckpt.PendingSave | None = None  # train.checkpoint_async: the save being written
        self.staging = ckpt.ReusedStaging()  # train.checkpoint_async: host buffers kept between saves

    @staticmethod
    def check(cfg: Config) -> None:
        """What the native engine cannot do, and the train.* fields that belong to another engine."""
        if cfg.train.deepspeed_config:
            raise ConfigError(
                f"train.deepspeed_config={cfg.train.deepspeed_config} is read only by the DeepSpeed engine; set "
                "train.engine=deepspeed or drop train.deepspeed_config"
            )
        if cfg.parallel.offload == "optimizer":
            raise ConfigError(
                "parallel.offload=optimizer has no PyTorch-native engine: FSDP2 offloads parameters, gradients and "
                "optimizer state together; use parallel.offload=params with parallel.strategy=zero2 or zero3, or "
                "train.engine=deepspeed (ZeRO-Offload)"
            )
        if cfg.train.ema and cfg.parallel.strategy not in ("single", "ddp", "zero1"):
            raise ConfigError(
                f"train.ema averages whole weights on every rank: it needs parallel.strategy single, ddp or zero1 "
                f"(got {cfg.parallel.strategy}); set train.ema=0 for this run"
            )

    # ------------------------------------------------------------------------------------------ step

    def autocast(self) -> contextlib.AbstractContextManager:
        return self.precision.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        self.precision.backward(loss / self.cfg.train.accum_steps)
        finish_reductions(self.model)  # zero2/zero3 on a CPU: the reduce-scatters that ran beside backward

    def forward_backward(
        self, images: torch.Tensor, labels: torch.Tensor, loss_fn: LossFn, timer: PhaseTimer | None = None
    ) -> torch.Tensor:
        if self.pipeline is not None:  # the schedule runs every stage's forward and backward
            loss = self.pipeline.forward_backward(images, labels, self.precision, self.cfg.train.accum_steps)
            if timer is not None:
                timer.lap("forward")  # forward and backward together: the schedule interleaves them
            return loss
        return forward_then_backward(self, images, labels, loss_fn, timer)

    def step(self, loss_nonfinite: torch.Tensor | None = None) -> tuple[float | None, bool]:
        clip = self.cfg.optim.clip_grad_norm
        if self.pipeline is not None:  # clipped by the norm over every stage
            grad_norm, skipped = self.pipeline.step(self.precision, self.optimizer, clip, loss_nonfinite)
        else:
            if self.head is not None:
                average_replicated_gradients(self.head)
            grad_norm, skipped = self.precision.step(
                self.optimizer, clip, loss_nonfinite, head_optimizer=self.head_optimizer
            )
            if self.ema is not None and not skipped:
                self.ema.update()
        if self.cfg.train.checkpoint_async and self.staging.layout is None and self.staging.preparing is None:
            self._prepare_staging()
        return grad_norm, skipped

    def _prepare_staging(self) -> None:
        """train.checkpoint_async, after the first step (the optimizer state exists): the save's host buffers are
        made in the background, so the first save only copies into them."""
        extra = self._extra_state()
        with self.precision.full_precision(self.optimizer):  # the state's layout as a save will see it
            self.staging.prepare(ckpt.state_to_save(self.model, self.optimizer, extra))

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizer, lr)
        if self.head_optimizer is not None:
            set_lr(self.head_optimizer, lr)

    def parameter_count(self) -> int:
        # A pipeline stage holds only its own part: the model's count from its shape instead.
        return unwrap(self.model).complexity().params if self.pipeline is not None else count_parameters(self.model)

    # ------------------------------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return self.precision.state_dict()

    def _extra_state(self) -> dict[str, Any]:
        """What a checkpoint holds beside the model and optimizer: compensation, the face head, the EMA weights."""
        extra = {}
        if self.precision.compensated:
            extra[COMPENSATION] = self.precision.compensation_state(self.model, self.optimizer)
        if self.head is not None:
            extra[HEAD] = self.head.checkpoint_state(self.head_optimizer)
        if self.ema is not None:
            extra[EMA] = self.ema.state()
        return extra

    def save(self, run_dir: Path, step: int, meta: dict[str, Any], keep: int) -> Path:
        extra = self._extra_state()
        with self.precision.full_precision(self.optimizer):  # fp32 weights in every mode
            # A diverged run keeps its last good checkpoint instead of saving inf/NaN (each rank checks its shard).
            with all_or_none("checking the weights before a checkpoint"):
                check_finite(self.model, self.optimizer)
                if self.head is not None:
                    check_finite(self.head, self.head_optimizer)
            if not self.cfg.train.checkpoint_async:
                return ckpt.save(run_dir, step, self.model, self.optimizer, meta, keep, extra)
            self.wait_for_save()  # one save at a time: the next waits for the one being written
            group = side_group("checkpoint")
            self.pending = ckpt.save_async(
                run_dir, step, self.model, self.optimizer, meta, keep, extra, group, self.staging
            )
            return self.pending.final

    def wait_for_save(self) -> Path | None:
        pending, self.pending = self.pending, None
        return pending.wait() if pending is not None else None

    def load(self, path: Path, meta: dict[str, Any]) -> bool:
        part = self.pipeline is not None
        with all_or_none(f"reading checkpoint {path}"):
            ckpt.check_model_matches(path, self.model, part=part)
        with self.precision.full_precision(self.optimizer):  # pure mode: fp32 weights and optimizer state
            ckpt.load_training_state(path, self.model, self.optimizer, part=part)
        if self.precision.compensated and (meta.get("precision") or {}).get("compensated"):
            ckpt.load_extra(path, {COMPENSATION: self.precision.compensation_state(self.model, self.optimizer)})
        if self.head is not None:
            self.head.load_checkpoint(path, self.head_optimizer)
        if self.ema is not None:
            if meta["config"]["train"].get("ema"):
                state = self.ema.state()
                ckpt.load_extra(path, {EMA: state})
                self.ema.loaded(state)
            else:  # turned on at resume: the average starts from the checkpoint's weights
                self.ema = WeightAverage(self.model, self.cfg.train.ema, self.cfg.train.ema_warmup)
        self.precision.load_state_dict(meta.get("precision"))
        return ckpt.load_rng(path)

    @staticmethod
    def load_weights(path: Path, meta: dict[str, Any], model: nn.Module) -> None:
        """A native (DCP) checkpoint's fp32 weights into a single-device `model`, in one process."""
        ckpt.load_model_weights(path, model)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        with self.precision.full_precision(self.optimizer):
            state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
            return {name: tensor.detach().float().cpu().clone() for name, tensor in state.items()}

    def scaler_fields(self) -> dict[str, Any]:
        scaler = self.precision.scaler
        return {} if scaler is None else {"loss_scale": scaler.scale, "skipped_steps": scaler.skipped_steps}

    def skip_report(self) -> tuple[dict[str, Any], str | None]:
        if self.precision.scaler is not None:  # the loss scale and the skipped count say it
            return self.scaler_fields(), None
        in_a_row, limit = self.precision.nonfinite_in_a_row, self.precision.max_nonfinite_skips
        fields = {"nonfinite_in_a_row": in_a_row, "nonfinite_skipped": self.precision.nonfinite_skipped}
        return fields, (
            f"loss or gradients hold inf/NaN: step skipped, weights unchanged ({in_a_row} in a row; "
            f"precision.max_nonfinite_skips={limit} in a row are skipped, then the run stops)"
        )

    @property
    def precision_label(self) -> str:
        return self.precision.resolved.label

    def frozen(self, module: nn.Module) -> Frozen:
        """`module` (a teacher) run beside the model: on its device in eval mode without gradients, under zero2/zero3
        sharded by the strategy's own FSDP2 units (gathered in the low dtype where the model's are), and computing in
        the step's dtype (autocast over its fp32 weights, so that nothing is copied)."""
        device, parallel = self.dist.device, self.cfg.parallel
        module = module.to(device).eval().requires_grad_(False)
        if parallel.strategy in ("zero2", "zero3"):
            # Its own blocks (parallel.block names the student's class); no activation checkpointing: no backward.
            own_units = dataclasses.replace(parallel, block="")
            fully_shard_model(module, own_units, device, self.precision.parallel_precision())
        return Frozen(module, device, self.precision.dtype if self.precision.mode != "fp32" else None)

    def describe(self) -> list[str]:
        return [self.precision.describe()]


class Frozen:
    """A frozen module's forward: under inference_mode, autocast to `dtype` (None: fp32), fp32 outputs."""

    def __init__(self, module: nn.Module, device: torch.device, dtype: torch.dtype | None):
        self.module, self.device, self.dtype = module, device, dtype

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode(), torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
            output = self.module(images)
        return output.to(torch.float32, copy=True)  # a normal tensor: inference tensors cannot join autograd


def time_modes(cfg: Config, model: nn.Module, dist: DistInfo) -> dict[str, float]:
    """auto precision's probe under zero2/zero3 on CPUs whose bf16 is not emulated: one block's forward and backward
    per mode (where the blocks differ, the average block: one of each kind timed, weighed by how many there are),
    timed on rank 0 for every rank (precision.resolve picks the fastest)."""
    plan = plan_of(model, cfg.parallel.wrap, cfg.parallel.block)
    timed: dict[str, float] | None = None
    if dist.is_main:
        compiled = compiles_norms(cfg.precision.compile_norms, dist.device)  # amp_o2 timed as it would train
        probes = plan.probes(cfg.train.batch_size)
        blocks = sum(count for _, _, count in probes)
        timed = {}
        for block, shape, count in probes:
            seconds = time_block_modes(block, shape, device=dist.device, compile_norms=compiled)
            for mode, s in seconds.items():
                timed[mode] = timed.get(mode, 0.0) + s * count / blocks
    return broadcast_object(timed)
