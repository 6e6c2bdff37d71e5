"""Pipeline parallelism on torch.distributed.pipelining: a (pipeline x data) mesh, stages, schedules, the step.

`parallel.pipeline_stages=K` cuts the ViT's blocks into K balanced stages (the patch embedding with the first, the
final norm and head with the last; models/plan.py's `stage_blocks` cuts them, `ViTStage` in models/vit.py holds a
stage and keeps the model's parameter names).
gpipe and 1f1b put one stage on each of K pipeline ranks; interleaved_1f1b puts two on each of K/2 (rank r holds
stages r and r + K/2, torch's looped layout), so K must be even and >= 4 there. The processes left over form the
data-parallel dimension: rank = pipeline_rank x replicas + data_rank, so the replicas of a stage are neighbours.
Along it ddp averages the gradients once per step and zero2/zero3 shard each stage with FSDP2 on the data mesh.

The trainer talks to a `Pipeline` through the few places a step differs:

    dist = pipeline.dist                                   # data_rank / data_size: which batches this rank reads
    part = pipeline.split(model)                           # this rank's stages, under the model's names
    part = pipeline.parallelize(part, cfg, device)         # data parallel over the data mesh, then the schedule
    loss = pipeline.forward_backward(images, labels, precision, accum_steps)
    grad_norm, skipped = pipeline.step(precision, optimizer, clip_grad_norm, loss_nonfinite)
    logits = pipeline.forward(images)                      # evaluation; None on ranks without the last stage
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from vitrain.config import ParallelConfig
from vitrain.errors import ConfigError
from vitrain.models.plan import plan_of, stage_blocks
from vitrain.models.vit import ViTStage
from vitrain.parallel.activation_checkpoint import apply_activation_checkpointing
from vitrain.parallel.distributed import DistInfo, sum_over_ranks
from vitrain.parallel.strategies import fully_shard_model

if TYPE_CHECKING:
    from vitrain.precision import ParallelPrecision, PrecisionPolicy

# The activations handed between stages in evaluation: (3 sizes, dtype) sent ahead of each tensor.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def stages_per_rank(schedule: str) -> int:
    """Stages each pipeline rank holds: two under interleaved_1f1b (virtual stages), one otherwise."""
    return 2 if schedule == "interleaved_1f1b" else 1


def pipeline_ranks(cfg: ParallelConfig) -> int:
    """Processes in one pipeline (one replica of the model)."""
    return cfg.pipeline_stages // stages_per_rank(cfg.pipeline_schedule)


def microbatches(cfg: ParallelConfig) -> int:
    """Micro-batches per step under pipelining: parallel.microbatches, or twice the number of stages."""
    return cfg.microbatches or 2 * cfg.pipeline_stages


class Pipeline:
    """This rank's place in the (pipeline x data) mesh, its stages and schedule, and the step's pipelined parts."""

    def __init__(
        self, cfg: ParallelConfig, info: DistInfo, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ):
        from torch.distributed.device_mesh import init_device_mesh

        self.cfg = cfg
        self.loss_fn = loss_fn  # the task's loss, computed on the last stage
        self.device = info.device
        self.num_stages = cfg.pipeline_stages
        self.ranks = pipeline_ranks(cfg)
        if info.world_size % self.ranks:
            per_rank = stages_per_rank(cfg.pipeline_schedule)
            raise ConfigError(
                f"parallel.pipeline_stages={self.num_stages} with parallel.pipeline_schedule={cfg.pipeline_schedule} "
                f"runs {self.ranks} processes per pipeline ({per_rank} stage(s) each), but {info.world_size} were "
                f"launched; launch a multiple of {self.ranks} (torchrun --nproc-per-node {self.ranks})"
            )
        self.replicas = info.world_size // self.ranks
        mesh = init_device_mesh(self.device.type, (self.ranks, self.replicas), mesh_dim_names=("pipeline", "data"))
        self.group = mesh["pipeline"].get_group()
        self.data_mesh = mesh["data"]
        self.rank = mesh.get_local_rank("pipeline")
        self.stage_indices = list(range(self.rank, self.num_stages, self.ranks))  # torch's looped layout
        self.has_first = 0 in self.stage_indices
        self.has_last = self.num_stages - 1 in self.stage_indices
        self.dist = dataclasses.replace(info, data_rank=mesh.get_local_rank("data"), data_size=self.replicas)
        self.microbatches = microbatches(cfg)
        self.chunks: list[ViTStage] = []
        self.schedule = None
        self._losses: list[torch.Tensor] = []
        self._loss_factor = 1.0

    def describe(self) -> str:
        return (
            f"pipeline: {self.num_stages} stages ({self.cfg.pipeline_schedule}, {self.microbatches} micro-batches) "
            f"on {self.ranks} ranks x {self.replicas} data-parallel replica(s); this rank holds stage(s) "
            f"{', '.join(map(str, self.stage_indices))}"
        )

    # ------------------------------------------------------------------------------------------ build

    def split(self, model: nn.Module) -> nn.Module:
        """This rank's part of `model` (its stages' blocks, the embedding and head where they belong); drop `model`."""
        blocks = stage_blocks(model.cfg.depth, self.num_stages)
        self.chunks = [ViTStage(model, blocks[s]) for s in self.stage_indices]
        if len(self.chunks) == 1:
            return self.chunks[0]
        # Interleaved: one module over both stages' pieces (the same modules) for the optimizer and checkpoints.
        return ViTStage(model, [i for s in self.stage_indices for i in blocks[s]])

    def parallelize(
        self, part: nn.Module, cfg: ParallelConfig, device: torch.device, precision: ParallelPrecision | None = None
    ) -> nn.Module:
        """Activation checkpointing, FSDP2 over the data mesh (zero2/zero3), then the stages and their schedule.

        Same signature as strategies.parallelize. Low-precision weights (`precision`: amp_o2) need zero2/zero3,
        where FSDP2 computes each stage in the low dtype on fp32 shards; a working copy per stage is not built.
        """
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        if precision is not None and cfg.strategy not in ("zero2", "zero3"):
            raise ConfigError(
                f"parallel.pipeline_stages={self.num_stages} with parallel.strategy={cfg.strategy} keeps fp32 weights, "
                f"but the precision resolved to {precision.param_dtype} weights; set precision.mode=amp_o1, or "
                "parallel.strategy=zero2 or zero3 for amp_o2"
            )
        plan = plan_of(part, cfg.wrap)
        apply_activation_checkpointing(plan.checkpoint_units, cfg.activation_checkpointing, cfg.checkpoint_every_k)
        if cfg.strategy in ("zero2", "zero3"):
            for chunk in self.chunks:
                fully_shard_model(chunk, cfg, device, precision, mesh=self.data_mesh)
        stages = [
            PipelineStage(chunk, index, self.num_stages, device, group=self.group)
            for chunk, index in zip(self.chunks, self.stage_indices, strict=True)
        ]
        # The loss is already divided by the micro-batches (_microbatch_loss): gradients accumulate over steps
        # (train.accum_steps), which the schedule's own division of every gradient at each step would break.
        common = dict(n_microbatches=self.microbatches, loss_fn=self._microbatch_loss, scale_grads=False)
        if cfg.pipeline_schedule == "interleaved_1f1b":
            self.schedule = ScheduleInterleaved1F1B(stages, **common)
        else:
            schedule_class = ScheduleGPipe if cfg.pipeline_schedule == "gpipe" else Schedule1F1B
            self.schedule = schedule_class(stages[0], **common)
        return part

    # ------------------------------------------------------------------------------------------ step

    def _microbatch_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one micro-batch, kept for the log, scaled for its share of the step's gradient."""
        loss = self.loss_fn(output, target)
        self._losses.append(loss.detach())
        return loss * self._loss_factor

    def forward_backward(
        self, images: torch.Tensor, labels: torch.Tensor, precision: PrecisionPolicy, accum_steps: int
    ) -> torch.Tensor:
        """Collective over the pipeline: one micro-step's forward and backward through the schedule.

        Returns the micro-step's loss (the mean over its micro-batches) on the rank with the last stage and 0
        elsewhere; `mean_loss` turns that into the global batch's loss.
        """
        self._losses = []
        # fp16 loss scaling multiplies the loss, as precision.backward does outside a pipeline.
        self._loss_factor = (precision.loss_scale or 1.0) / (self.microbatches * accum_steps)
        target = labels if self.has_last else None
        with precision.autocast():
            if self.has_first:
                self.schedule.step(images, target=target, return_outputs=False)
            else:
                self.schedule.step(target=target, return_outputs=False)
        if not self._losses:
            return torch.zeros((), device=self.device)
        # The step's micro-batches are the last losses: the first step's shape inference calls the loss too, on
        # an uninitialized stand-in for the previous stage's output.
        return torch.stack(self._losses[-self.microbatches :]).mean()

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Collective: the global batch's loss from each replica's last stage (other ranks contribute 0)."""
        return sum_over_ranks(loss.detach()) / self.replicas

    def step(
        self,
        precision: PrecisionPolicy,
        optimizer: torch.optim.Optimizer,
        clip_grad_norm: float,
        loss_nonfinite: torch.Tensor | None,
    ) -> tuple[float | None, bool]:
        """Collective: average over the replicas (ddp), then the precision's step, clipping by the norm over every
        stage (reduced over the pipeline, as torchtitan's clip_grad_norm_ does) and skipping on all ranks together."""
        if self.cfg.strategy == "ddp" and self.replicas > 1:
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            self._average_over_replicas(grads)
        return precision.step(optimizer, clip_grad_norm, loss_nonfinite, norm_group=self.group)

    def _average_over_replicas(self, grads: list[torch.Tensor]) -> None:
        """ddp under pipelining: one all-reduce of the step's accumulated gradients over the data mesh."""
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.data_mesh.get_group())
        flat /= self.replicas
        parts = flat.split([g.numel() for g in grads])
        torch._foreach_copy_(grads, [part.view_as(g) for part, g in zip(parts, grads, strict=True)])

    # ------------------------------------------------------------------------------------------ evaluation

    def forward(self, images: torch.Tensor) -> torch.Tensor | None:
        """Collective over the pipeline: the model's output for a whole batch, stage after stage, no micro-batches.

        Evaluation batches vary in size (the last one is short), which the schedule's shapes, fixed at its first
        step, cannot; here each stage tells the next the shape it sends. None on ranks without the last stage.
        """
        x = images
        for stage, chunk in zip(self.stage_indices, self.chunks, strict=True):
            if stage > 0:
                x = self._receive((stage - 1) % self.ranks)
            x = chunk(x)
            if stage < self.num_stages - 1:
                self._send(x, (stage + 1) % self.ranks)
        return x if self.has_last else None

    def train(self, mode: bool = True) -> None:
        for chunk in self.chunks:
            chunk.train(mode)

    def eval(self) -> None:
        self.train(False)

    @property
    def training(self) -> bool:
        return self.chunks[0].training

    def __call__(self, images: torch.Tensor) -> torch.Tensor | None:
        return self.forward(images)

    def _send(self, x: torch.Tensor, to: int) -> None:
        header = torch.tensor([*x.shape, _DTYPES.index(x.dtype)], dtype=torch.int64, device=x.device)
        dist.send(header, group_dst=to, group=self.group)
        dist.send(x.contiguous(), group_dst=to, group=self.group)

    def _receive(self, source: int) -> torch.Tensor:
        header = torch.empty(4, dtype=torch.int64, device=self.device)
        dist.recv(header, group_src=source, group=self.group)
        *shape, dtype = header.tolist()
        x = torch.empty(shape, dtype=_DTYPES[dtype], device=self.device)
        dist.recv(x, group_src=source, group=self.group)
        return x
