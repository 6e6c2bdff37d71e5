"""One typed config: dataclass sections loaded from YAML plus dotted command-line overrides, validated."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import inspect
import json
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from vitrain import registry, trust
from vitrain.errors import ConfigError
from vitrain.trust import flatten  # vitrain.config.flatten: one definition, in the module config imports

# Recipes ship inside the package (package data), so a regular install finds them from any working directory.
CONFIG_DIR = Path(__file__).resolve().parent / "configs"
DEFAULT_RECIPE = "digits"  # what `vitrain train` and `vitrain.train()` train when no recipe is named


@dataclass
class ModelConfig:
    # vit: vitrain's ViT (the fields below); timm:NAME a timm model (pip install 'vitrain[peers]'); mypkg.module:fn
    # a user's factory, called with this config section, returning an nn.Module (docs/library.md).
    name: str = "vit"
    preset: str | None = None  # a name from `vitrain models`; explicit fields below override it
    image_size: int = 224  # input side in pixels (square)
    patch_size: int = 16  # side of one patch token in pixels
    in_chans: int = 3  # input channels: 3 for RGB, 1 for grey
    num_classes: int = 1000  # classifier outputs
    width: int = 192  # token width (embedding dimension)
    depth: int = 12  # transformer blocks
    heads: int = 3  # attention heads (width must divide by it)
    mlp_dim: int | None = None  # None: 4 x width
    qkv_bias: bool = True  # bias on the attention's query/key/value projection
    # cls: the class token; gap: the mean of the patch tokens; flatten: every patch token, concatenated (the input
    # of a face-recognition embedding neck, as insightface's ViT does)
    pool: Literal["cls", "gap", "flatten"] = "cls"
    # seq_first: blocks compute on (tokens, batch, width) instead of (batch, tokens, width)
    layout: Literal["batch_first", "seq_first"] = "batch_first"
    # auto: the faster of sdpa and manual for this model, batch, precision and device, timed before training
    # (vitrain/engine/autotune.py, cached per device and shape); the weights are the same either way.
    attention: Literal["auto", "sdpa", "manual"] = "auto"
    pos_embed: Literal["learned", "sincos"] = "learned"  # learned position table, or a fixed 2-D sine-cosine one
    # linear: one strided conv cuts non-overlapping patches (ViT). conv: a small convolutional stem (3x3 convs, each
    # with BatchNorm and ReLU, then a 1x1 projection to width; Xiao et al. 2021, "Early convolutions help
    # transformers see better"), which learns faster from few images; the same token grid either way.
    patch_embed: Literal["linear", "conv"] = "linear"
    # conv: output channels of each 3x3 conv; the last log2(patch_size) have stride 2, any before them stride 1.
    # Empty: log2(patch_size) convs widening to width (e.g. patch 4, width 192: [96, 192]).
    stem_channels: tuple[int, ...] = ()
    # task.name=detection (ViTDet): blocks attend within windows of this many tokens a side (ViTDet: 14); 0: every
    # block attends globally
    window_size: int = 14
    global_blocks: tuple[int, ...] = (2, 5, 8, 11)  # task.name=detection: the blocks that attend over the whole map
    drop_path: float = 0.0  # stochastic depth: the last block's drop rate (linear from 0)
    dropout: float = 0.0  # dropout after the position embedding (mvit: before the classifier; its preset 0.5)
    # a local timm or vitrain weights file (.safetensors/.pt/.pth) to fine-tune from (mvit: torchvision's file too)
    init_from: str = ""
    # video_vit: frames of each clip the model sees (data.source=video samples this many); 1: an image model
    num_frames: int = 1
    # video_vit: frames per tubelet token (the Conv3d's temporal kernel and stride); must divide num_frames
    tubelet_size: int = 1
    # video_vit: an image ViT's weights (.safetensors/.pt/.pth, vitrain export or timm) inflated to this video model
    # (vitrain/models/video.py); empty: random initialisation
    inflate_from: str = ""
    inflate: Literal["average", "center"] = "average"  # the patch embedding over time: weights / t, or centre frame
    # mvit (MViTv2): blocks per stage; each stage after the first halves the grid and doubles width and heads
    # (MViTv2-S: [1, 2, 11, 2], model.depth their sum); empty for every other model
    stages: tuple[int, ...] = ()

    @property
    def hidden_dim(self) -> int:
        return self.mlp_dim if self.mlp_dim is not None else 4 * self.width

    @property
    def num_patches(self) -> int:
        """Patch tokens of one input: (num_frames / tubelet_size) x (image_size / patch_size)^2."""
        return (self.num_frames // self.tubelet_size) * (self.image_size // self.patch_size) ** 2

    @property
    def sample_unit(self) -> str:
        """What one sample is, for the lines a reader sees: a clip of num_frames frames for a video model, else an
        image (the JSON keeps the `images_per_s` key for both)."""
        return "clip" if self.num_frames > 1 else "image"

    @property
    def stem(self) -> tuple[tuple[int, int], ...]:
        """patch_embed=conv: (out channels, stride) of each 3x3 conv of the stem; empty for the linear embedding."""
        if self.patch_embed != "conv":
            return ()
        halvings = self.patch_size.bit_length() - 1
        channels = self.stem_channels or tuple(self.width >> (halvings - i) for i in range(1, halvings + 1))
        return tuple((c, 2 if i >= len(channels) - halvings else 1) for i, c in enumerate(channels))


@dataclass
class DataConfig:
    # folder: an ImageFolder tree, a .zip of one, or a folder made by `vitrain data prepare` (read as prepared);
    # shards: WebDataset tar shards, streamed; recordio: MXNet/insightface .rec files (docs/data.md)
    # digits, folder, prepared, shards, recordio, synthetic, or a user's mypkg.module:fn returning (train, val)
    source: str = "digits"
    # where the data is: a folder or zip; shards: a folder of .tar files, a list file, a brace pattern
    # `train-{000000..000099}.tar` or `pipe:COMMAND` (e.g. `pipe:aws s3 cp s3://b/train-{000..099}.tar -`);
    # recordio: a folder with train.rec (+ .idx, property) or a .rec file
    root: str = ""
    val_root: str = ""  # shards: the validation shards (same forms as root); empty: the split's or held out
    shard_index: str = ""  # shards: index.json with each shard's sample count (needed for pipe: shards)
    shuffle_buffer: int = 1000  # shards: each loader worker shuffles windows of this many consecutive samples
    train_split: str = "train"  # folder source: the training split's folder name
    val_split: str = "test"  # when the folder has no such split, val_fraction of train is held out
    val_fraction: float = 0.2  # held out of train when there is no val_split
    mean: tuple[float, ...] = (0.5,)  # per-channel normalization mean (of pixels in [0, 1])
    std: tuple[float, ...] = (0.5,)  # per-channel normalization std
    crop_padding: int = 0  # random crop after padding by this many pixels; 0 turns it off
    hflip: float = 0.0  # probability of a horizontal flip
    # task.name=detection: large-scale jitter (ViTDet's is [0.1, 2.0]): each training image is rescaled by a factor
    # from this range, then cropped or padded back to model.image_size; [1, 1] turns it off.
    jitter_scale: tuple[float, float] = (1.0, 1.0)
    decode_workers: int = 2  # processes decoding image files once at start
    # folder, shards, recordio (not faces): JPEGs at least twice model.image_size decode at the smallest DCT scale
    # (1/8 steps) still >= it, then resize: less decoding work, pixels slightly unlike a full decode's.
    decode_reduce: bool = True
    synthetic_samples: int = 1024  # synthetic source: random images per split
    # Progressive resizing (FFCV's): > 0 trains at this smaller size first (a multiple of model.patch_size; fewer
    # tokens, a faster step), growing in patch-size steps to model.image_size between the two fractions of the
    # schedule in size_ramp; evaluation is always at model.image_size. 0 turns it off.
    min_size: int = 0
    # data.min_size: fractions of the run where the size starts and ends growing
    size_ramp: tuple[float, float] = (0.25, 0.75)
    random_resized_crop: bool = False  # replaces crop_padding: a random box of rrc_scale area, resized back
    rrc_scale: tuple[float, float] = (0.08, 1.0)  # fraction of the image area
    rrc_ratio: tuple[float, float] = (0.75, 1.3333333333333333)  # aspect ratio w/h of the box
    mixup_alpha: float = 0.0  # > 0: mix each batch with its reverse, weight ~ Beta(alpha, alpha)
    cutmix_alpha: float = 0.0  # > 0: paste a box of the reversed batch, area ~ Beta(alpha, alpha)
    cutmix_prob: float = 0.5  # with both mixup and cutmix on, the chance that a batch uses cutmix
    # RandAugment as timm writes it (rand-m9-mstd0.5-inc1 is DeiT's; empty: off): n ops per image (default 2), each
    # applied with probability p (0.5), at magnitude m of 10 plus N(0, mstd) noise; inc1: the ops that grow stronger
    # with m. Strong augmentation runs on the training device, each image its own ops (docs/augment.md); one of
    # randaugment, trivialaugment and three_augment at a time.
    randaugment: str = ""
    trivialaugment: bool = False  # TrivialAugment (torchvision's wide): one op of 14 per image at a random strength
    # DeiT III's 3-Augment: grayscale, solarize or Gaussian blur per image, then color_jitter (0.3 unless set)
    three_augment: bool = False
    # Brightness, contrast and saturation each scaled by a factor from [1 - j, 1 + j] in an order drawn per image
    # (torchvision's ColorJitter, no hue), after any policy above; null: 0.3 with three_augment (DeiT III), else off.
    color_jitter: float | None = None
    # The chance that an image gets one box (2-33% of its area) of per-pixel noise (timm's reprob, mode pixel; DeiT
    # uses 0.25). 0 turns it off.
    random_erasing: float = 0.0
    # Repeated augmentation (DeiT's RASampler uses 3): each epoch's images repeated this many times in a row, the
    # copies dealt to consecutive ranks, the epoch kept at its length (it sees 1/k of the images, k times each, each
    # copy augmented on its own). 1 turns it off.
    repeated_aug: int = 1
    loader: Literal["fast", "plain"] = "fast"  # plain: per-sample PIL decoding in DataLoader workers (baseline)
    loader_workers: int = 2  # plain loader and shards: DataLoader worker processes decoding samples
    prefetch: int = 2  # fast loader: batches prepared ahead in a background thread; 0 turns it off
    # folder source (a tree or a zip): up to this many image files that do not decode are skipped, each named in
    # log.txt and counted in summary.json; one more stops the run naming it. Files without an image suffix are
    # never read: they are counted and named too, not silently ignored. shards / recordio: up to this many bad
    # samples (no label, an image that does not decode) give their place in the batch to another sample, named
    # in log.txt and counted as skipped_samples.
    skip_bad: int = 0
    verify: Literal["once", "always"] = "once"  # prepared data: sha256 once per file change, or every load
    # data.source=video: read the frame folders (<class>/<clip>/NNN.jpg) instead of the video files
    # (<class>/<clip>.mp4|.avi); a tree may hold both (docs/video.md)
    video_frames: bool = False
    frame_stride: int = 1  # data.source=video: a clip takes every this-many-th frame (model.num_frames of them)
    # data.source=video: clips whose path (relative to data.root) matches this regex, such as "actor[678]_", are the
    # validation split; empty: train_split/val_split folders, else val_fraction of the clips held out
    val_match: str = ""


@dataclass
class OptimConfig:
    # muon: Muon for the blocks' weight matrices (orthogonalized momentum, AdamW-matched RMS), AdamW for the rest
    name: Literal["adamw", "sgd", "lamb", "lars", "muon"] = "adamw"
    lr: float = 1e-3  # peak learning rate
    weight_decay: float = 0.05  # decoupled weight decay (not on norms, biases and tokens)
    betas: tuple[float, float] = (0.9, 0.999)  # adamw, lamb, muon's AdamW tensors
    muon_momentum: float = 0.95  # muon: Nesterov momentum of the matrices' updates
    eps: float = 1e-8  # adamw, lamb, muon's AdamW tensors: denominator epsilon
    momentum: float = 0.9  # sgd, lars
    nesterov: bool = False  # sgd
    trust_coefficient: float = 0.001  # lars: scales each layer's step by ||w|| / ||g||
    # auto: fastest on the device; flat: all parameters as views into one buffer per group, one fused update each.
    impl: Literal["auto", "fused", "foreach", "loop", "flat"] = "auto"
    clip_grad_norm: float = 1.0  # 0 turns clipping off
    head_lr_scale: float = 1.0  # the head's lr = lr x this (the classifier, or the face task's identity head)
    head_weight_decay: float | None = None  # None: same as weight_decay
    layer_decay: float = 1.0  # layer-wise lr decay for fine-tuning: block i gets lr x layer_decay^(depth+1-i); 1 = off


@dataclass
class ScheduleConfig:
    # the learning-rate schedule's shape
    name: Literal["warmup_cosine", "constant", "onecycle", "cyclic", "step"] = "warmup_cosine"
    warmup_epochs: float = 1.0  # linear warmup before cosine, cyclic and step (onecycle has its own ramp)
    min_lr: float = 1e-6  # the lr the decay ends at
    onecycle_pct: float = 0.3  # onecycle: fraction of the run spent ramping up from lr / div_factor
    div_factor: float = 25.0  # onecycle: starting lr = lr / div_factor
    final_div_factor: float = 1e4  # onecycle: final lr = lr / div_factor / final_div_factor
    cycle_epochs: float = 4.0  # cyclic: length of one triangle min_lr -> lr -> min_lr
    cycle_decay: float = 1.0  # cyclic: the peak is multiplied by this after each cycle (0.5: "triangular2")
    milestones: tuple[float, ...] = ()  # step: epochs at which the lr is multiplied by gamma
    gamma: float = 0.1  # step
    # steps: the schedule runs over train.epochs. time: over train.time_limit_s instead (also capped by epochs): the
    # lr at a step is the schedule's value at the share of the time budget spent on training so far (setup and the
    # last evaluation left out), so the decay ends as the budget does on a fast or a slow machine alike.
    horizon: Literal["steps", "time"] = "steps"
    scale_lr: Literal["none", "linear"] = "none"  # linear: lr x global_batch / base_batch_size (Goyal et al.)
    base_batch_size: int = 256  # scale_lr=linear: the batch the configured lr is for


@dataclass
class DistillConfig:
    """Knowledge distillation (DeiT): the student learns from a frozen teacher's predictions beside the labels."""

    # The teacher, empty for none: a vitrain run folder (its newest complete checkpoint) or step folder, an export
    # folder or its model.safetensors (config.yaml beside it), or timm:NAME (timm's pretrained weights, or
    # teacher_weights); its classes must be the task's. The student ViT gains a distillation token and head.
    teacher: str = ""
    # hard: the distillation head learns the teacher's top class (cross-entropy); soft: its temperature-softened
    # distribution (KL divergence x tau^2)
    type: Literal["hard", "soft"] = "hard"
    alpha: float = 0.5  # weight of the distillation head's loss; the class head's label loss gets 1 - alpha
    tau: float = 1.0  # type=soft: the temperature both distributions are softened by
    # teacher=timm:NAME: a local weights file (.safetensors; .pt/.pth read without pickle) with the teacher's
    # weights instead of timm's download; empty: timm's pretrained weights (the hub, or its cache offline)
    teacher_weights: str = ""


@dataclass
class TrainConfig:
    epochs: int = 10  # passes over the training data
    batch_size: int = 128  # per device, per micro-step
    accum_steps: int = 1  # micro-batches per optimizer step (gradient accumulation)
    label_smoothing: float = 0.1  # classification: cross-entropy label smoothing
    seed: int = 0  # weights, data order and augmentation follow from it
    device: str = "auto"  # auto: cuda when available, else cpu
    threads: int = 0  # torch intra-op threads on CPU; 0 leaves torch's default
    # CPU, glibc: keep freed memory in the heap and map no large block afresh, so each step's activations reuse
    # pages instead of faulting in zeroed ones (1.08x on a ViT-S/16 step, docs/performance.md)
    reuse_host_memory: bool = True
    # CPU: linear layers add their bias inside oneDNN's GEMM instead of aten's addmm, which writes the bias into the
    # whole output first, and in bf16 a patch embedding's conv (kernel = stride) computes as one such GEMM over the
    # patches (vitrain/models/kernels.py; not under train.compile, which fuses by itself)
    fused_linear: bool = True
    compile: bool = False  # torch.compile the model (the first step's time is logged as compile_s)
    eval_every_epochs: int = 1  # evaluate (and checkpoint) every this many epochs, and at the end
    eval_at_s: tuple[float, ...] = ()  # also evaluate at the first step past each of these wall-clock seconds
    checkpoint_every_steps: int = 0  # 0: checkpoint at the end of each epoch only
    max_steps: int = 0  # 0: no limit; otherwise stop after this many optimizer steps
    keep_checkpoints: int = 3  # the newest K step checkpoints are kept (plus the best one)
    # Native engine: write checkpoints with DCP's async save. The step loop waits only while the state is copied to
    # host memory; a background thread writes the files (over a gloo group of its own); a second save waits for it.
    checkpoint_async: bool = False
    # > 0: stop training once this many seconds of wall time (counted from the start of the run's setup, data
    # decoding included) plus the last evaluation's duration are spent, then evaluate once more: a time budget.
    time_limit_s: float = 0.0
    # > 0: keep an exponential moving average of the weights with this decay (e.g. 0.999), evaluated beside the
    # weights (ema_val_* fields) and checkpointed. Native engine, strategies single/ddp/zero1.
    ema: float = 0.0
    ema_warmup: bool = True  # decay min(ema, (1 + t) / (10 + t)) at step t: short runs forget the random start
    # Also evaluate each image averaged with its mirror image (logits of both added): *_flip fields, reported beside
    # the plain ones, never in their place.
    eval_flip: bool = False
    # What sets up, steps and checkpoints the model (vitrain/engine/native.py): native (vitrain's precision policy,
    # parallel strategy and DCP checkpoints) or deepspeed (DeepSpeed ZeRO; pip install 'vitrain[deepspeed]').
    engine: str = "native"  # or a user's engine class by import path (the protocol in vitrain/engine/protocol.py)
    # A user's DeepSpeed JSON (train.engine=deepspeed): its "auto" values are filled from this config and a concrete
    # value that disagrees with it is an error; keys vitrain does not map pass through (docs/deepspeed.md).
    deepspeed_config: str = ""
    # Token dropping (PatchDropout; FLIP's random masking): each training image keeps a random subset of its patch
    # tokens, dropping this fraction (0.5: half the tokens, about half the step's compute); the class and
    # distillation tokens are always kept, evaluation sees every token. 0 turns it off.
    token_drop: float = 0.0
    # train.token_drop: the fraction of the schedule after which training sees every token again (0.9: the last
    # 10% of the steps unmasked, FLIP's unmasked tuning); 1: drop until the end.
    token_drop_until: float = 1.0
    distill: DistillConfig = field(default_factory=DistillConfig)  # knowledge distillation from a teacher


@dataclass
class PrecisionConfig:
    # auto: the fastest numerically safe policy for the device (logged); see vitrain/precision.py for each mode.
    mode: Literal["auto", "fp32", "amp_o1", "amp_o2", "pure"] = "auto"
    dtype: Literal["bf16", "fp16"] = "bf16"  # the low dtype of amp_o1, amp_o2 and pure
    # pure only: keep a low-dtype Kahan compensation buffer per weight, so that updates below the low dtype's
    # resolution accumulate instead of rounding away (2 more bytes per parameter, fp32 optimizer state);
    # false = the least memory (optimizer state in the low dtype too) and the accuracy risk in docs/precision.
    compensated: bool = True
    # fp16 dynamic loss scaling (bf16 and fp32 use none).
    init_scale: float = 65536.0
    growth_interval: int = 2000  # double the scale after this many steps without an overflow
    min_scale: float = 1.0  # fp16: the loss scale never goes below this
    max_overflows_at_min: int = 20  # this many consecutive overflows at min_scale stop the run
    # fp32 / bf16: a step whose loss or gradients hold inf/NaN is skipped (weights untouched, logged); more than
    # this many in a row stop the run with its last good checkpoint kept. 0: stop at the first.
    max_nonfinite_skips: int = 3
    # amp_o2 under a parallel strategy: the dtype gradients are averaged in across ranks (FSDP2's reduce_dtype,
    # a DDP communication hook); fp32 is exact to the single-process sum, bf16/fp16 halve the traffic.
    reduce_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    # amp_o2/pure: class names of the layers kept in fp32 beside the norms (LayerNorm, GroupNorm, RMSNorm, BatchNorm
    # always are), e.g. [Attention] for a model of your own whose softmax needs it.
    fp32_modules: tuple[str, ...] = ()
    # amp_o2 (the working copy's norms under single, ddp, zero1; FSDP2's fp32 norm unit under zero2, zero3): each
    # LayerNorm's upcast, fp32 norm and downcast as one torch.compile'd kernel in training (the casts otherwise make
    # two extra passes each way).
    # Costs a compile in the first step (seconds; cached on disk after) and a C++ compiler on a CPU (Triton on a
    # GPU). auto: on a CPU whose C++ compiler and Python headers are there (steps 1.03-1.07x faster on a 2-core
    # Zen 4: docs/performance.md), off elsewhere; true: wherever it applies, and a missing compiler is an error.
    # Ignored by the other modes and by train.engine=deepspeed.
    compile_norms: bool | Literal["auto"] = "auto"


@dataclass
class ParallelConfig:
    """How the model is spread over devices; launched with torchrun (one process per device)."""

    # single: one device; ddp: replicated model; zero1: DDP + sharded optimizer state (ZeroRedundancyOptimizer);
    # zero2 / zero3: FSDP2 sharding that keeps / frees the gathered parameters between forward and backward.
    strategy: Literal["single", "ddp", "zero1", "zero2", "zero3"] = "single"
    # FSDP unit: the whole model, each block (peak = one block), or each block's attention and MLP separately
    # (sublayer: half a block's parameters gathered at a time, for the lowest peak); auto: autotune times them under
    # the run's own zero2 (zero3: block and sublayer) and keeps the fastest; where it does not run (VITRAIN_AUTOTUNE=0,
    # DeepSpeed, pipeline stages), the whole model under zero2, each block under zero3 (vitrain/models/plan.py).
    wrap: Literal["auto", "model", "block", "sublayer"] = "auto"
    # The class name of the repeated block that is a sharding unit and what activation checkpointing recomputes, for
    # a model other than vitrain's ViT; empty: the longest ModuleList/Sequential of one class (vitrain/models/plan.py).
    block: str = ""
    # params: zero2/zero3 keep shards, gradients and optimizer state in host memory
    offload: Literal["none", "optimizer", "params"] = "none"
    # recompute each block's activations in backward (or every k-th block)
    activation_checkpointing: Literal["none", "block", "every_k"] = "none"
    checkpoint_every_k: int = 2  # activation_checkpointing=every_k: recompute blocks 0, k, 2k, ...
    # zero2/zero3: gather the next unit's parameters during this unit's backward (overlap on GPUs, one more
    # unit of memory); off keeps one unit gathered at a time.
    backward_prefetch: bool = True
    # zero2/zero3 on a CPU (gloo): each unit's gradient reduce-scatter runs on the process group's thread beside the
    # rest of backward, and the next unit's all-gather beside this unit's forward (vitrain/parallel/overlap.py; on a
    # GPU FSDP2 does both on its streams). With train.accum_steps > 1 the reduce-scatters block as FSDP2's own do.
    overlap_comm: bool = True
    # zero2/zero3: how gradients are reduced across ranks. reduce_scatter: FSDP2's own; all_reduce: an all-reduce of
    # the whole gradient of which each rank keeps its shard (what DDP and DeepSpeed's `reduce_scatter: false` call;
    # gloo's reduce-scatter is a clone of its input and that all-reduce); auto: all_reduce on gloo, reduce_scatter
    # elsewhere (vitrain/parallel/overlap.py).
    grad_reduce: Literal["auto", "reduce_scatter", "all_reduce"] = "auto"
    # zero2/zero3: build the model on the meta device and draw only this rank's shards, one tensor at a time (the
    # same weights as a whole build); the build then needs one tensor of host memory instead of the whole fp32 model.
    sharded_init: bool = False
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl on cuda, gloo on cpu
    # BatchNorm layers (the face neck) normalize with the statistics of the whole global batch, so a run trains alike
    # on any number of ranks and resumes exactly on another; false: each rank's own batch (less communication).
    sync_batchnorm: bool = True
    # Pipeline parallelism (torch.distributed.pipelining): the blocks split into this many balanced stages (patch
    # embedding with the first, final norm and head with the last), one stage per process; the processes left over
    # form the data-parallel dimension of a 2-D (pipeline x data) mesh. 1: no pipelining.
    pipeline_stages: int = 1
    microbatches: int = 0  # micro-batches per step's batch under pipelining; 0: twice the number of stages
    # the order of the stages' micro-batch forward and backward passes
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"


@dataclass
class LogConfig:
    out_dir: str = "runs"  # runs are written to out_dir/<name>/
    every_steps: int = 10  # a metrics record (loss, lr, images/s) every this many steps
    progress: bool = True  # a progress bar per epoch on stderr, drawn on a terminal or in a notebook (not into files)
    # Also write every metrics.jsonl record as TensorBoard scalars under RUN/tensorboard (pip install
    # 'vitrain[tensorboard]'); `vitrain plot RUN` draws the same curves without it.
    tensorboard: bool = False
    # Also log the run to Weights & Biases (pip install 'vitrain[wandb]'): the resolved config, every metrics.jsonl
    # record at its step, summary.json's fields; rank 0 only (docs/export-and-trackers.md).
    wandb: bool = False
    wandb_project: str = "vitrain"  # the W&B project the run goes to (its name is the run's name)
    # offline: the run is written under RUN/wandb only and nothing is sent (`wandb sync RUN/wandb/offline-run-*`
    # uploads it later); online: it streams to the W&B server `wandb login` set up.
    wandb_mode: Literal["offline", "online"] = "offline"
    # Also log the run to MLflow (pip install 'vitrain[mlflow]'): the resolved config as params, every metrics.jsonl
    # record's numbers as metrics at their step, the summary; rank 0 only.
    mlflow: bool = False
    # Empty: a SQLite store under RUN/mlflow (nothing is sent); or a server (http://host:5000), or sqlite:///PATH.db.
    mlflow_tracking_uri: str = ""
    mlflow_experiment: str = "vitrain"  # the MLflow experiment the run goes to (its name is the run's name)


@dataclass
class RunConfig:
    """How a run behaves on a shared cluster: signals, requeue, hangs (docs/cluster.md)."""

    # On any of these signals every rank finishes its step, the ranks agree at the next step boundary, one checkpoint
    # (with the data position) is written and the process exits 75; running the same command again continues it.
    stop_signals: tuple[str, ...] = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")
    # Under SLURM: after a stop's checkpoint, rank 0 runs `scontrol requeue` for this job (once); the requeued job
    # continues the run (--resume auto is the default there).
    requeue: bool = False
    # A collective that waits longer than this raises (gloo and NCCL) and the process exits non-zero; sized so that
    # the slowest rank's checkpoint write fits.
    collective_timeout_s: float = 1800.0
    # Step watchdog: when no optimizer step completes within max(watchdog_min_s, watchdog_steps x the median step
    # time), every rank logs the stacks of all its threads and exits 70 (restart, resume). Paused during evaluations
    # and saves. 0: off.
    watchdog_steps: float = 20.0
    watchdog_min_s: float = 300.0  # the watchdog's shortest deadline in seconds


@dataclass
class TaskConfig:
    """What the model is trained to do: its head, loss, evaluation and best metric (vitrain/tasks)."""

    name: str = "classification"  # classification, face, or a user's task class by import path (mypkg.tasks:MyTask)
    pyramid_channels: int = 256  # detection: channels of each feature pyramid level and of the FCOS head (ViTDet: 256)
    head_convs: int = 4  # detection: 3x3 conv + GroupNorm + ReLU layers in each of the head's two towers
    score_threshold: float = 0.05  # detection: detections below this class probability are dropped
    nms_iou: float = 0.6  # detection: a box overlapping a better one of its class by more than this IoU is dropped
    max_detections: int = 100  # detection: detections kept per image
    # detection: train only the pyramid and head over a fixed backbone (its start: random, or model.init_from): the
    # baseline that shows what training the backbone adds
    freeze_backbone: bool = False
    # face: the backbone ends in an embedding neck (Linear to embed_dim, then BatchNorm1d) instead of a classifier;
    # the identity centres live in a margin head outside the backbone, with optim.head_lr_scale and
    # optim.head_weight_decay as its own lr and weight decay.
    embed_dim: int = 512
    # face: the margin softmax of the identity head
    margin: Literal["arcface", "cosface", "combined", "softmax"] = "cosface"
    scale: float = 64.0  # s: logits are s x cos(angle), margins applied to the true identity's cosine
    arcface_m: float = 0.5  # arcface: cos(theta + m)
    cosface_m: float = 0.35  # cosface: cos(theta) - m
    combined_m: tuple[float, float, float] = (1.0, 0.3, 0.2)  # combined (m1, m2, m3): cos(m1 theta + m2) - m3
    # Partial FC: each step every identity of the global batch plus this fraction of the others (per rank's shard)
    sample_rate: float = 1.0
    shard_head: bool = True  # split the identity centres over the ranks (false: every rank holds all of them)
    # Identities held out of training for verification: how many, and how they are picked (seeded: at random by
    # train.seed-independent SPLIT_SEED; last: the last ones in sorted order, e.g. CFP's 451-500).
    verify_identities: int = 10
    # seeded: held-out identities drawn at random; last: the last ones in sorted order
    identity_split: Literal["seeded", "last"] = "seeded"
    # Verification pair sets: generated (balanced, seeded, over the held-out identities), cfp-ff / cfp-fp (CFP's
    # official protocol, restricted to the held-out identities), or the path of an LFW-format pairs file.
    pairs: tuple[str, ...] = ("generated",)
    generated_pairs: int = 3000  # generated: up to this many matched and as many mismatched pairs
    flip_fusion: bool = True  # embedding = normalize(f(image) + f(flipped image))
    baseline: bool = True  # also score the pairs with raw-pixel cosine similarity, for comparison
    # video: clips per validation video, uniformly spaced, their logits averaged for the video accuracy (Kinetics'
    # multi-view protocol); 1: the centre clip
    eval_clips: int = 4
    # video: a finished run of the frame-averaged image baseline (its folder, with summary.json); its top-1 is reported
    # as `baseline` in this run's summary beside the model's own. Empty: none.
    baseline_run: str = ""


@dataclass
class Config:
    name: str = "run"
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    log: LogConfig = field(default_factory=LogConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.log.out_dir) / self.name


# ---------------------------------------------------------------------------------------------- loading


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    base: dict[str, Any] | None = None,
    check: bool = True,
    *,
    untrusted: str | Path | None = None,
    trusted: Mapping[str, Any] | None = None,
    data: bool = True,
) -> Config:
    """Resolve a config: defaults <- model preset <- YAML file (or `base` dict) <- `section.key=value` overrides;
    validated unless `check` is off (a resume reads only where the run is from it, and checks the run's own).

    `untrusted`: `base` was read from this file of a checkpoint or run folder, so the result may name no module to
    import and (`data`) no pipe: command that neither the overrides nor `trusted` (dotted keys) give (vitrain/trust.py).

    A preset named by an override replaces the architecture the file gives (`vitrain bench model.preset=
    vit_base_patch16` on the digits recipe is ViT-B/16 at 224 px, not its width on 16 px digits); the overrides'
    own architecture fields still win over it."""
    check_overrides(overrides)
    raw: dict[str, Any] = copy.deepcopy(base) if base is not None else {}
    if path is not None:
        raw = read_config_file(Path(path))
    parsed = [_parse_override(item) for item in overrides or []]
    named = [p["model"]["preset"] for p in parsed if isinstance(p.get("model"), dict) and "preset" in p["model"]]
    if named:
        from vitrain.presets import find_preset  # models import config: import late

        preset = find_preset(str(named[-1]))
        for key in _preset_model(preset) if preset is not None else PRESET_FIELDS:
            (raw.get("model") or {}).pop(key, None)
    for item in parsed:
        _merge(raw, item)
    if untrusted is not None:
        typed = {key: value for item in parsed for key, value in flatten(item).items()}
        trust.check_config(raw, untrusted, {**(trusted or {}), **typed}, data)
    try:
        _apply_preset(raw)
        cfg = _build(Config, raw, prefix="")
        if check:
            validate(cfg)
    except ConfigError as error:
        if untrusted is None or type(error) is not ConfigError:
            raise
        given = " with the command line's overrides" if overrides else ""
        raise ConfigError(f"{error} (the config read from {untrusted}{given})") from None
    return cfg


def config_from_dict(
    raw: dict[str, Any],
    where: str | Path = "a saved config",
    trusted: Mapping[str, Any] | None = None,
    data: bool = True,
    fix: str = trust.COMMAND_LINE,
) -> Config:
    """Rebuild a config saved by `to_dict` (for example inside a checkpoint), read from `where`: untrusted, so it may
    name no module to import and (`data`) no pipe: command that `trusted` (dotted keys) does not give (trust.py)."""
    trust.check_config(raw, where, trusted, data, fix)
    cfg = _build(Config, dict(raw), prefix="")
    validate(cfg)
    return cfg


def to_dict(cfg: Config) -> dict[str, Any]:
    def plain(v: Any) -> Any:
        if isinstance(v, tuple | list):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(dataclasses.asdict(cfg))


def trusted_values(cfg: Config) -> dict[str, Any]:
    """A config the user gave (or one that passed vitrain/trust.py's check) as the values it trusts, by dotted key."""
    return flatten(to_dict(cfg))


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def resolve_config_path(name: str) -> Path:
    """Accept a path, or the name of a shipped recipe (`cifar10` -> vitrain/configs/cifar10.yaml)."""
    path = Path(name)
    if path.exists():
        return path
    for candidate in (CONFIG_DIR / name, CONFIG_DIR / f"{name}.yaml"):
        if candidate.exists():
            return candidate
    section, dot, key = name.partition(".")
    if dot and key in _section_keys().get(section, ()):  # `vitrain train model.depth`: a key without its value
        raise ConfigError(f"{name} is a config key without a value; write {name}=VALUE")
    close = difflib.get_close_matches(name, recipe_names(), n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise ConfigError(
        f"config file {name} not found; {hint}give a YAML path or a recipe name: {', '.join(recipe_names())} "
        "(`vitrain config list` describes them)"
    )


def _section_keys() -> dict[str, list[str]]:
    """Each section's field names: {"model": ["name", "preset", ...], ...}."""
    hints = typing.get_type_hints(Config)
    return {
        f.name: [g.name for g in dataclasses.fields(hints[f.name])]
        for f in dataclasses.fields(Config)
        if dataclasses.is_dataclass(hints[f.name])
    }


@dataclass(frozen=True)
class KeyHelp:
    key: str  # section.key
    type: str
    default: str
    help: str  # the field's comment in this file, its first sentence


def config_keys(section: str | None = None) -> list[KeyHelp]:
    """Every key of the typed config (or of one section) with its type, default and the comment beside it here:
    read from the dataclasses and this file's source, so the listing cannot drift from the config."""
    hints = typing.get_type_hints(Config)
    rows = []
    for top in dataclasses.fields(Config):
        cls = hints[top.name]
        if not dataclasses.is_dataclass(cls):
            if section is None:
                rows.append(KeyHelp(top.name, _type_name(cls), repr(top.default), "the run's name: runs/<name>/"))
            continue
        if section is not None and top.name != section:
            continue
        rows += _section_rows(top.name, cls)
    if section is not None and not rows:
        close = difflib.get_close_matches(section, list(_section_keys()), n=1)
        hint = f"did you mean {close[0]}?" if close else f"sections: {', '.join(_section_keys())}"
        raise ConfigError(f"config section {section} does not exist; {hint}")
    return rows


def _section_rows(prefix: str, cls: type) -> list[KeyHelp]:
    """The keys of one section, a nested section's (train.distill) under its own prefix."""
    comments, defaults, field_hints = _field_comments(cls), cls(), typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        hint = field_hints[f.name]
        if dataclasses.is_dataclass(hint):
            rows += _section_rows(f"{prefix}.{f.name}", hint)
            continue
        default = getattr(defaults, f.name)
        shown = list(default) if isinstance(default, tuple) else default
        rows.append(KeyHelp(f"{prefix}.{f.name}", _type_name(hint), json.dumps(shown), comments.get(f.name, "")))
    return rows


def _type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return "|".join(map(str, args))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is tuple:
        return f"list of {_type_name(args[0])}"
    return "null" if hint is type(None) else getattr(hint, "__name__", str(hint))


# A full stop and a space end a sentence, except after "e.g." and "i.e.", which never end one.
_SENTENCE_END = re.compile(r"(?<=\.)(?<!\be\.g\.)(?<!\bi\.e\.)\s")


def _field_comments(cls: type) -> dict[str, str]:
    """The comment on each field's line, or else the comment lines just above it, first sentence only."""
    comments: dict[str, str] = {}
    above: list[str] = []
    for line in inspect.getsource(cls).splitlines()[1:]:
        text = line.strip()
        if text.startswith("#"):
            above.append(text.lstrip("#").strip())
            continue
        match = re.match(r"(\w+): ", text)
        if match and not text.startswith(("def ", "return ")):
            beside = text.partition("  # ")[2]
            note = beside or " ".join(above)
            comments[match.group(1)] = _SENTENCE_END.split(note, maxsplit=1)[0]
        above = []
    return comments


def recipe_names() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def recipe_description(path: Path) -> str:
    """A recipe's first comment line: each shipped recipe opens with one saying what it trains."""
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
        if line.strip():
            break
    return ""


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping, where PyYAML would keep the last one silently."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    problem=f"key {key} is given twice (lines {seen[key]} and {line}); keep one",
                    problem_mark=key_node.start_mark,
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_config_file(path: Path, fix: str = "") -> dict[str, Any]:
    """The one place a config file is read: a file that is missing, a directory, not text, not YAML or not a mapping
    is one line naming it, ending with `fix` where the caller knows a better one than giving another file."""

    def refuse(problem: str, default_fix: str) -> ConfigError:
        return ConfigError(f"config file {path} {problem}; {fix or default_fix}")

    if not path.exists():
        raise refuse("not found", "check the path, or give a recipe name (vitrain config list)")
    if path.is_dir():
        raise refuse("is a directory, not a YAML file", "give a .yaml file or a recipe name")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise refuse("is not a YAML file (not UTF-8 text)", "give a YAML recipe") from None
    except OSError as error:
        raise refuse(f"cannot be read ({error.strerror})", "give a readable YAML file") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # safe: a SafeLoader that also refuses repeated keys
    except yaml.reader.ReaderError as error:  # control characters: a binary file that happens to be UTF-8
        raise refuse(f"is not a YAML file ({error.reason})", "give a YAML recipe") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1} " if mark is not None else ""
        raise refuse(f"{where}is not valid YAML: {getattr(exc, 'problem', exc)}", "fix the line") from None
    if data is None:  # an empty recipe: the defaults
        return {}
    if not isinstance(data, dict):
        raise refuse(f"must hold a mapping of sections, got {type(data).__name__}", "e.g. `optim: {lr: 0.001}`")
    return data


def check_overrides(overrides: Any) -> None:
    """Refuse overrides that are not a list (or tuple) of strings: a lone string would be read letter by letter."""
    if overrides is None or (isinstance(overrides, list | tuple) and all(isinstance(o, str) for o in overrides)):
        return
    given = repr(overrides) if len(repr(overrides)) <= 60 else f"a {type(overrides).__name__}"
    raise ConfigError(f"overrides must be a list of 'section.key=value' strings, e.g. ['train.epochs=2']; got {given}")


def _parse_override(item: str) -> dict[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value, e.g. optim.lr=3e-3")
    dotted, value = item.split("=", 1)
    keys = dotted.strip().split(".")
    if any(not k for k in keys):
        raise ConfigError(f"override {item!r} has an empty key; write it as section.key=value")
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
        text = value.strip()
        if text[:1] in "[{" and text.count(text[0]) > text.count("]" if text[0] == "[" else "}"):  # cut short
            closing = "]" if text[0] == "[" else "}"
            raise ConfigError(
                f"override {item!r}: {text} is not a whole YAML list or mapping; close it with {closing!r} "
                "(quote the value in the shell)"
            ) from None
        parsed = value
    node: dict[str, Any] = {}
    cursor = node
    for k in keys[:-1]:
        cursor[k] = {}
        cursor = cursor[k]
    cursor[keys[-1]] = parsed
    return node


def override_keys(overrides: list[str]) -> set[str]:
    """The dotted keys `overrides` set: `data.root=X` sets data.root, `data={root: X}` too (a mapping merges into
    its section, so only the keys it names are set)."""
    keys: set[str] = set()
    for item in overrides:
        keys |= set(flatten(_parse_override(item)))
    return keys


def _merge(base: dict[str, Any], extra: dict[str, Any], prefix: str = "") -> None:
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v, f"{prefix}{k}.")
        elif isinstance(v, dict) and base.get(k) is not None:  # `train: 5` in the file, then train.max_steps=1
            raise ConfigError(f"{prefix}{k} must be a mapping of keys, got {base[k]!r}")
        else:
            base[k] = v


# What a model preset sets (stages: MViTv2's, empty for the others)
PRESET_FIELDS = ("width", "depth", "heads", "mlp_dim", "patch_size", "image_size", "stages")


def _apply_preset(raw: dict[str, Any]) -> None:
    model = raw.get("model")
    if not isinstance(model, dict) or model.get("preset") in (None, ""):  # a preset of 0 is looked up, and refused
        return
    from vitrain.presets import find_preset, preset_names  # models import config: import late

    preset = find_preset(str(model["preset"]))
    if preset is None:
        close = difflib.get_close_matches(str(model["preset"]), preset_names(), n=1)
        hint = f"did you mean {close[0]}?" if close else "run `vitrain models` for the list"
        raise ConfigError(f"model.preset={model['preset']} is not a known preset; {hint}")
    raw["model"] = {**_preset_model(preset), **model, "preset": preset.name}


def _preset_model(preset: Any) -> dict[str, Any]:
    """The model fields a preset sets: what a preset named by an override takes over from the file."""
    arch = {field: getattr(preset, field) for field in PRESET_FIELDS}
    if preset.stages:  # MViTv2: pooling attention over stages, classified from its class token
        arch |= {"name": "mvit", "num_frames": preset.num_frames, "tubelet_size": preset.tubelet_size, "pool": "cls",
                 "pos_embed": "learned", "drop_path": preset.drop_path, "dropout": 0.5}  # fmt: skip
    elif preset.is_video:  # VideoMAE's choices; the model section may still override each
        arch |= {"name": "video_vit", "num_frames": preset.num_frames, "tubelet_size": preset.tubelet_size,
                 "pool": "gap", "pos_embed": "sincos"}  # fmt: skip
    return arch


def _build(cls: type, raw: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "config"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping of keys, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        if key not in names:
            elsewhere = [f"{section}.{key}" for section, fields in _section_keys().items() if key in fields]
            close = difflib.get_close_matches(str(key), names, n=1)
            if elsewhere and prefix:  # the right key in another section: data.batch_size -> train.batch_size
                hint = f"did you mean {' or '.join(elsewhere)}?"
            else:
                hint = f"did you mean {prefix}{close[0]}?" if close else f"known keys: {', '.join(names)}"
            raise ConfigError(f"unknown config key {prefix}{key}; {hint} (`vitrain config keys` lists them all)")
        hint_type = hints[key]
        if dataclasses.is_dataclass(hint_type):
            kwargs[key] = _build(hint_type, value, prefix=f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(value, hint_type, f"{prefix}{key}")
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, name: str) -> Any:
    """Convert a YAML/CLI value to the field's declared type, or raise naming the field."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        if isinstance(value, str) and value.lower() in ("none", "null") and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _coerce(value, inner[0], name)
        for member in inner:  # e.g. bool | Literal["auto"]: the first member that takes the value
            try:
                return _coerce(value, member, name)
            except ConfigError:
                pass
        allowed = ", ".join("true, false" if a is bool else _type_name(a).replace("|", ", ") for a in inner)
        raise ConfigError(f"{name}={value!r} is not allowed; choose one of: {allowed}")
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint_text = f"did you mean {close[0]}?" if close else f"choose one of: {', '.join(map(str, args))}"
            raise ConfigError(f"{name}={value} is not allowed; {hint_text}")
        return value
    if origin is tuple:
        if isinstance(value, int | float):
            value = [value]
        if isinstance(value, str):
            value = [v for v in value.strip("()[] ").split(",") if v.strip()]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{name}={value!r} must be a list, e.g. {name}=[0.5,0.5,0.5]")
        item_type = args[0]
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, item_type, name) for v in value)
        if len(value) != len(args):
            raise ConfigError(f"{name}={list(value)} must have {len(args)} values")
        return tuple(_coerce(v, t, name) for v, t in zip(value, args, strict=True))
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "on", "off", "1", "0"):
            return value.lower() in ("true", "yes", "on", "1")
        raise ConfigError(f"{name}={value!r} must be true or false")
    if hint is int:
        if isinstance(value, bool) or not _is_intlike(value):
            raise ConfigError(f"{name}={value!r} must be an integer")
        return int(value)
    if hint is float:
        if isinstance(value, bool):
            raise ConfigError(f"{name}={value!r} must be a number")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name}={value!r} must be a number, e.g. {name}=3e-4") from None
        if not math.isfinite(number):  # no float field gives nan or inf a meaning (their "off" is 0)
            reads_as = "" if str(value).lower().lstrip(".+") == str(number).lstrip("+") else f" (it reads as {number})"
            raise ConfigError(f"{name}={value} must be a finite number{reads_as}; nan and inf are not allowed")
        return number
    if hint is str:
        if isinstance(value, dict | list):
            raise ConfigError(f"{name}={value!r} must be a single value, not a {type(value).__name__}")
        return str(value)
    raise ConfigError(f"{name} has an unsupported type {hint}")


def _is_intlike(value: Any) -> bool:
    if isinstance(value, int):
        return True
    if isinstance(value, float):
        return value.is_integer()
    if isinstance(value, str):
        try:
            int(value)
            return True
        except ValueError:
            return False
    return False


# ---------------------------------------------------------------------------------------------- checks


def validate(cfg: Config) -> None:
    """Hand each section to its owner's check and the named engine, task, model and data source to their own
    `check(cfg)` where they have one (registry.CHECK_ORDER): a bad value gets one line naming it and the fix."""
    if not cfg.name or "/" in cfg.name:
        raise ConfigError(f"name={cfg.name!r} must be a non-empty run name without '/'")
    names = {"engine": cfg.train.engine, "task": cfg.task.name, "model": cfg.model.name, "data": cfg.data.source}
    for check in registry.checks(names):
        check(cfg)
