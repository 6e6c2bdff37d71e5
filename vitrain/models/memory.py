"""Memory model: bytes per device for a ViT under single/ddp/zero1/zero2/zero3, pipeline stages, offload and AC.

Model states are what vitrain's native engine allocates (AdamW: two fp32 moments), in bytes per parameter with N
data-parallel devices; amp_o2 (bf16 or fp16) under single/ddp/zero1 adds the fp32 master copy the optimizer steps
and the fp32 gradients vitrain/precision.py makes for it from the low-dtype working copy's at each step:

    strategy        fp32: weights, gradients, moments   amp_o2: working weights, gradients, moments, master, its grads
    single, ddp     4 + 4 + 8 = 16                      2 + 2 + 8 + 4 + 4 = 20
    zero1           4 + 4 + 8 / N                       2 + 2 + 8 / N + 4 + 4
    zero2, zero3    (4 + 4 + 8) / N                     (4 + 4 + 8) / N: fp32 shards, FSDP2's gathered units below

ddp's gradients are its all-reduce buckets (the parameters' gradients are views into them), kept between steps.
zero1 is DDP plus ZeroRedundancyOptimizer over the whole fp32 model: each rank keeps the moments of its own slice
only, but every weight, every gradient and, under amp_o2, the whole master copy and all its gradients; so amp_o2
costs 4 bytes per parameter more than fp32 under single, ddp and zero1, where the ZeRO paper's accounting
(DeepSpeed's: 2 + 2 + 12 / N under stage 1) would say it saves. The master gradients exist from the step to the
next zero_grad (the CPU's flat optimizer under single keeps them), and are added to the activations' peak like
every other state: on a GPU, where they are freed before the next forward, that bounds the peak from above by up to
4 bytes per parameter. train.ema adds an fp32 copy of the weights the optimizer steps, whole on every rank (4 bytes
per parameter; single, ddp and zero1 only, as the engine allows).

FSDP2 adds transient full-size copies: the all-gathered parameters of the unit being computed and of the one
being prefetched, and the unsharded gradients of a unit plus the flat buffer they are reduce-scattered from.
Activations are per device (they do not shrink with N): every block's saved tensors without checkpointing;
with per-block checkpointing only each block's input plus one block's tensors during its recompute; with every k-th
block checkpointed (blocks 0, k, 2k, ...: parallel.activation_checkpointing=every_k) those keep their input and the
others all their tensors.

Mixed precision under zero2/zero3 is FSDP2's `MixedPrecisionPolicy`: the sharded parameters stay fp32 (they are
the master copy, no second one), gradients are reduced into fp32 shards, and only the gathered units and the
activations are in the low dtype; the total of sharded states is the same 16 bytes per parameter / N.

Pipeline stages split the blocks into S stages, one per process (the patch embedding with the first, the final
norm and head with the last); each process holds the model states of its largest stage, divided over the
devices / S data-parallel ranks as the strategy says, and the first stage keeps the activations of up to S
micro-batches (1F1B) in flight.

The peak of a process is the larger of training and building: by default vitrain builds the whole fp32 model on
every process before it shards or splits it (`build="whole"`), so 4 bytes per parameter are needed once whatever the
strategy; `build="sharded"` is zero2/zero3 with `parallel.sharded_init=true`, which builds on the meta device and
materializes only each process's shards, one tensor at a time (vitrain/parallel/materialize.py). `baseline_bytes` is
what a process holds besides the model: on a CPU the interpreter, torch and the process group (0.33 GiB here,
benchmarks/largest_model.py measures it); on a GPU the CUDA context and kernels.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vitrain.config import ModelConfig
from vitrain.errors import ConfigError
from vitrain.models import complexity, config_complexity
from vitrain.models.plan import auto_wrap, check_stages

STRATEGIES = ("single", "ddp", "zero1", "zero2", "zero3")
BUILDS = ("whole", "sharded")
# bytes per element: weights, gradients, optimizer moments, fp32 master copy, its gradients, activations
PRECISIONS = {
    "fp32": (4, 4, 8, 0, 0, 4),
    # amp_o2: low-dtype working weights and gradients, fp32 moments, fp32 master weights and their fp32 gradients
    "bf16": (2, 2, 8, 4, 4, 2),
    "fp16": (2, 2, 8, 4, 4, 2),
}
# FSDP2 units in flight at the peak (wrap=block): the block being computed plus the prefetched one.
UNITS_IN_FLIGHT = 2
FP32 = 4


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device: `total` at the training peak, `peak` with the build and baseline; `host_bytes` offloaded."""

    weights: int
    gradients: int
    optimizer: int
    master: int
    gathered: int  # transient unsharded parameters and gradients of FSDP units
    activations: int
    host_bytes: int = 0
    build: int = 0  # held while the model is built, before it is sharded or split (the whole fp32 model)
    baseline: int = 0  # the process without the model: interpreter, torch, process group (CPU) or CUDA context
    master_gradients: int = 0  # amp_o2 under single/ddp/zero1: the fp32 gradients the optimizer steps with
    ema: int = 0  # train.ema: an fp32 copy of the weights, whole on every rank

    @property
    def model_states(self) -> int:
        master = self.master + self.master_gradients
        return self.weights + self.gradients + self.optimizer + master + self.ema + self.gathered

    @property
    def total(self) -> int:
        """Bytes at the training peak: model states plus activations."""
        return self.model_states + self.activations

    @property
    def peak(self) -> int:
        """What one process needs: its baseline plus the larger of the training peak and the build."""
        return self.baseline + max(self.total, self.build)

    def as_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "model_states": self.model_states, "total": self.total, "peak": self.peak}


def _block_params(cfg: ModelConfig) -> int:
    return complexity(dataclasses.replace(cfg, depth=2)).params - complexity(dataclasses.replace(cfg, depth=1)).params


def _sublayer_params(cfg: ModelConfig) -> int:
    """The larger of a block's two FSDP units under wrap=sublayer: attention or MLP."""
    d, h = cfg.width, cfg.hidden_dim
    attention = 3 * d * d + (3 * d if cfg.qkv_bias else 0) + d * d + d
    return max(attention, 2 * d * h + h + d)


def activation_bytes(cfg: ModelConfig, batch: int, ac: bool, bytes_per_element: int, every_k: int = 1) -> int:
    """Saved activations of one training step on one device with `batch` images; with `ac` the blocks 0, k, 2k, ...
    (k = `every_k`; 1: every block) keep only their input and recompute the rest in backward."""
    one = complexity(dataclasses.replace(cfg, depth=1), batch).activations
    block = complexity(dataclasses.replace(cfg, depth=2), batch).activations - one
    outside = one - block  # patch embedding, final norm, head
    if not ac:
        return (outside + cfg.depth * block) * bytes_per_element
    tokens = cfg.num_patches + (1 if cfg.pool == "cls" else 0)
    block_input = batch * tokens * cfg.width
    recomputed = range(0, cfg.depth, every_k)  # as parallel/activation_checkpoint.py chooses them
    kept = cfg.depth - len(recomputed)
    # Backward reaches the last recomputed block after freeing the kept blocks behind it: its recompute (one
    # block's tensors) raises the peak only where no kept block follows it; else the peak is where backward starts.
    after = cfg.depth - 1 - recomputed[-1]
    held = max(kept, kept - after + 1)
    return (outside + len(recomputed) * block_input + held * block) * bytes_per_element


def _root_params(cfg: ModelConfig) -> tuple[int, int]:
    """(first stage's, last stage's) parameters outside the blocks: embeddings; final norm and head."""
    params = complexity(cfg).params
    head = params - complexity(dataclasses.replace(cfg, num_classes=0)).params + 2 * cfg.width  # with final norm
    return params - cfg.depth * _block_params(cfg) - head, head


def _largest_stage(cfg: ModelConfig, stages: int) -> tuple[ModelConfig, int]:
    """The pipeline stage with the most parameters (as a model of its blocks) and its parameter count.

    Stages hold depth // stages blocks each, one more for the stages after the first while the remainder lasts (the
    first also holds the embeddings, the last the final norm and head), as models/plan.py splits them.
    """
    counts = [cfg.depth // stages + (1 if 0 < i <= cfg.depth % stages else 0) for i in range(stages)]
    embed, head = _root_params(cfg)
    sizes = [
        c * _block_params(cfg) + (embed if i == 0 else 0) + (head if i == stages - 1 else 0)
        for i, c in enumerate(counts)
    ]
    largest = max(range(stages), key=sizes.__getitem__)
    return dataclasses.replace(cfg, depth=counts[largest]), sizes[largest]


def estimate(
    cfg: ModelConfig,
    devices: int,
    strategy: str,
    wrap: str = "auto",
    offload: bool = False,
    ac: bool = False,
    checkpoint_every_k: int = 1,
    batch: int = 1,
    precision: str = "fp32",
    prefetch: bool = True,
    pipeline_stages: int = 1,
    microbatches: int = 0,
    build: str = "whole",
    baseline_bytes: int = 0,
    ema: bool = False,
) -> MemoryEstimate:
    """Per-process bytes for training `cfg` with AdamW on `devices` processes, `batch` images per process and step.

    With `pipeline_stages` S > 1 the processes form S stages x devices / S data-parallel ranks, `strategy` acting
    over the data-parallel ranks; `microbatches` 0 means 2 S. `ac` with `checkpoint_every_k` k > 1: only blocks
    0, k, 2k, ... are checkpointed (each pipeline stage counts its own blocks from 0). `wrap` "auto" is the FSDP
    unit a run with parallel.wrap=auto uses where autotune does not time it (the whole model under zero2). `ema`:
    train.ema's average of the weights (vitrain/engine/ema.py).
    """
    if strategy not in STRATEGIES:
        raise ConfigError(f"strategy={strategy} is unknown; choose one of: {', '.join(STRATEGIES)}")
    if precision not in PRECISIONS:
        raise ConfigError(f"precision={precision} is unknown; choose one of: {', '.join(PRECISIONS)}")
    if build not in BUILDS:
        raise ConfigError(f"build={build} is unknown; choose one of: {', '.join(BUILDS)}")
    if devices <= 0 or batch <= 0 or checkpoint_every_k <= 0:
        raise ConfigError(
            f"devices={devices}, batch={batch} and checkpoint_every_k={checkpoint_every_k} must be positive"
        )
    if pipeline_stages <= 0 or devices % pipeline_stages:
        raise ConfigError(f"pipeline_stages={pipeline_stages} must divide devices={devices}")
    check_stages(pipeline_stages, cfg.depth, "pipeline_stages")
    if offload and strategy not in ("zero2", "zero3"):
        raise ConfigError(f"offload needs strategy zero2 or zero3 (FSDP2), got {strategy}")
    if ema and strategy not in ("single", "ddp", "zero1"):
        raise ConfigError(
            f"train.ema averages whole weights on every rank: it needs single, ddp or zero1, got {strategy}"
        )
    wrap = auto_wrap(strategy) if wrap == "auto" else wrap
    if cfg.name == "mvit":
        return _mvit_estimate(cfg, devices, strategy, ac, pipeline_stages, batch, precision, build, baseline_bytes, ema)
    w, g, o, m, mg, a = PRECISIONS[precision]
    sharded = strategy in ("zero2", "zero3")
    if sharded:
        # FSDP2 mixed precision: fp32 shards are the master, low-dtype copies exist only while gathered, and
        # gradients are reduce-scattered straight into fp32 shards (no second gradient copy).
        w, g, m, mg = FP32, FP32, 0, 0
    gathered_w = PRECISIONS[precision][0]
    whole, stage = complexity(cfg).params, cfg
    params = whole
    if pipeline_stages > 1:
        stage, params = _largest_stage(cfg, pipeline_stages)
    n = devices // pipeline_stages if strategy != "single" else 1
    shard = {"single": (1, 1, 1), "ddp": (1, 1, 1), "zero1": (1, 1, n), "zero2": (n, n, n), "zero3": (n, n, n)}
    w_div, g_div, o_div = shard[strategy]
    weights, gradients = params * w // w_div, params * g // g_div
    # zero1's master copy and its gradients are whole on every rank (ZeroRedundancyOptimizer over the fp32 model,
    # precision.py's step fills every master gradient); zero2/zero3 have none.
    optimizer, master, master_gradients = params * o // o_div, params * m, params * mg
    gathered = 0
    if sharded and n > 1:
        unit = {"block": _block_params(cfg), "sublayer": _sublayer_params(cfg)}.get(wrap, params)
        units = min(UNITS_IN_FLIGHT if prefetch else 1, stage.depth)
        low_g = PRECISIONS[precision][1]
        resident = 0 if offload else gradients  # gradient shards in device memory
        if wrap == "model":
            # One unit, gathered whole in backward under zero2 and zero3 alike. FSDP2 reshards it (frees the
            # gathered weights) before it allocates the fp32 buffer its gradients are reduce-scattered from, so the
            # peak holds its unsharded gradients beside either, and no gradient shard yet (the gradient term stands
            # for part of these bytes, counted once). Measured zero2, 2 ranks: fp32 and bf16 within the per-process
            # overhead; counting the weights and the buffer together was 4 and 2 bytes per parameter over.
            gathered = max(0, unit * low_g + max(unit * gathered_w, unit * FP32) - resident)
        else:
            # Gradients: a unit's unsharded gradients plus the fp32 flat buffer they are reduce-scattered from. The
            # unit's own weights are freed before that buffer is made, but with several units the room goes to
            # reductions left in flight (parallel/overlap.py keeps up to IN_FLIGHT pending on a CPU; FSDP2 overlaps
            # its own on a GPU), so the unit is counted whole.
            gathered = unit * (low_g + FP32)
            if strategy == "zero3":
                gathered += units * unit * gathered_w  # only the units in flight
                gathered += (params - stage.depth * _block_params(cfg)) * gathered_w  # root: embeddings, head
            else:
                # zero2 keeps every unit's gathered weights from forward to backward. Backward releases them unit
                # by unit while the gradient shards fill up, so the peak is at its start: all gathered weights, no
                # gradient shards yet (the gradient term above stands for the same bytes, counted once).
                gathered += max(0, params * gathered_w - resident)
    host = 0
    if offload:
        host = weights + gradients + optimizer + master
        weights = gradients = optimizer = master = 0
    activations = activation_bytes(stage, batch, ac, a, checkpoint_every_k)
    if pipeline_stages > 1:
        # 1F1B: the first stage holds up to S micro-batches' activations of the step's M.
        micro = microbatches or 2 * pipeline_stages
        activations = activations * min(pipeline_stages, micro) // micro
    return MemoryEstimate(
        weights=weights,
        gradients=gradients,
        optimizer=optimizer,
        master=master,
        gathered=gathered,
        activations=activations,
        host_bytes=host,
        build=whole * FP32 if build == "whole" else 0,
        baseline=baseline_bytes,
        master_gradients=master_gradients,
        # A deep copy of the model the optimizer steps (the fp32 master under amp_o2), in fp32 on its device.
        ema=params * FP32 if ema else 0,
    )


def _mvit_estimate(
    cfg: ModelConfig,
    devices: int,
    strategy: str,
    ac: bool,
    pipeline_stages: int,
    batch: int,
    precision: str,
    build: str,
    baseline_bytes: int,
    ema: bool,
) -> MemoryEstimate:
    """MViTv2 (model.name=mvit) with its weights whole on each device (single, ddp, zero1: the optimizer's states
    sharded): its stages' exact parameters and the tensors a step keeps for backward (vitrain/models/mvit.py counts
    both; autotune's memory check asks for this). Its blocks differ in size, so the FSDP, checkpointed and pipelined
    terms of `estimate` are not modelled for it."""
    from vitrain.models.mvit import complexity as mvit_complexity

    if strategy not in ("single", "ddp", "zero1") or ac or pipeline_stages > 1:
        raise ConfigError(
            "the memory model counts MViTv2 (model.name=mvit) with whole weights on each device (strategy single, "
            f"ddp or zero1), without activation checkpointing or pipeline stages (asked: strategy={strategy}, ac={ac}, "
            f"pipeline_stages={pipeline_stages}); measure it that way with `{mvit_bench(cfg)}` and the run's "
            "parallel.* keys"
        )
    w, g, o, m, mg, a = PRECISIONS[precision]
    cost = mvit_complexity(cfg, batch)  # activations for the batch; parameters once
    params = cost.params
    shards = devices if strategy == "zero1" else 1  # ZeroRedundancyOptimizer: each rank holds its part of the states
    return MemoryEstimate(
        weights=params * w,
        gradients=params * g,
        optimizer=params * o // shards,
        master=params * m,
        gathered=0,
        activations=cost.activations * a,
        host_bytes=0,
        build=params * FP32 if build == "whole" else 0,
        baseline=baseline_bytes,
        master_gradients=params * mg,
        ema=params * FP32 if ema else 0,
    )


def devices_needed(cfg: ModelConfig, device_bytes: int, max_devices: int = 1 << 16, **kwargs) -> int | None:
    """The fewest devices on which each device's peak fits in `device_bytes` (None: not within max_devices).

    The share never grows with more devices, so doubling finds a bound and bisection the minimum. With pipeline
    stages the devices come in multiples of the stages.
    """
    stages = kwargs.get("pipeline_stages", 1)

    def fits(k: int) -> bool:
        return estimate(cfg, devices=k * stages, **kwargs).peak <= device_bytes

    if fits(1):
        return stages
    if kwargs.get("strategy", "single") in ("single", "ddp") or not fits(max_devices // stages):
        return None  # replicated state: more devices never lower the per-device share
    low, high = 1, 2
    while not fits(high):
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if fits(mid) else (mid, high)
    return high * stages


def ladder(base: dict | None = None, steps: int = 16) -> list[ModelConfig]:
    """ViTs on the presets' proportions, smallest first: `steps` models from each preset to the next.

    Between two consecutive presets width, depth, heads and MLP ratio are interpolated geometrically (width a whole
    number of heads of a multiple of 8, so every preset is itself on the ladder); `base` sets the other fields
    (image and patch size, classes). A model that would not have more parameters than the one before is skipped.
    """
    from vitrain.models import PRESETS

    presets = [p for p in PRESETS.values() if not p.is_video]  # the image family's proportions
    models: list[ModelConfig] = []
    for a, b in zip(presets[:-1], presets[1:], strict=True):
        for k in range(steps + (1 if b is presets[-1] else 0)):
            t = k / steps

            def between(x: float, y: float, t: float = t) -> float:
                return x * (y / x) ** t

            heads = round(between(a.heads, b.heads))
            width = heads * max(8, round(between(a.width, b.width) / heads / 8) * 8)
            mlp_ratio = between(a.mlp_dim / a.width, b.mlp_dim / b.width)
            model = ModelConfig(
                **{
                    **(base or {}),
                    "width": width,
                    "depth": round(between(a.depth, b.depth)),
                    "heads": heads,
                    "mlp_dim": round(width * mlp_ratio / 64) * 64,
                }
            )
            if not models or complexity(model).params > complexity(models[-1]).params:
                models.append(model)
    return models


def largest_that_fits(models: list[ModelConfig], device_bytes: int, **kwargs) -> int | None:
    """Index of the largest of `models` (ordered by size) whose estimated peak fits in `device_bytes`."""
    fitting = [i for i, model in enumerate(models) if estimate(model, **kwargs).peak <= device_bytes]
    return fitting[-1] if fitting else None


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def mvit_bench(cfg: ModelConfig) -> str:
    """The command that measures an MViT's memory where the model here does not reach."""
    model = (
        f"model.preset={cfg.preset} model.image_size={cfg.image_size}"
        if cfg.preset
        else "model.name=mvit <its model.* keys>"
    )
    return _clip_bench(model)


def _clip_bench(model: str) -> str:
    """`vitrain bench run` of the model `model` (its model.* keys) on synthetic clips."""
    return f"vitrain bench run {model} data.source=synthetic task.name=video"


def mvit_refusal(preset: str) -> str:
    """`vitrain estimate`'s one line for an MViTv2 preset in a table of presets, whose columns it does not model."""
    bench = _clip_bench(f"model.preset={preset}")
    return (
        f"vitrain estimate's tables model vitrain's ViT and video ViT; {preset} is MViTv2 (model.name=mvit): give it "
        f"alone (`vitrain estimate {preset} --strategy ddp`), or measure it with `{bench} train.batch_size=2`"
    )


def preset_models(first: str | None = None, **fields) -> dict[str, ModelConfig]:
    """Every preset's model by alias, with `fields` (e.g. image_size) replacing the preset's.

    With `first`: that preset and those listed after it of the same kind (image or video), so that a table from an
    image preset up does not take in the video presets listed among the image ones.
    """
    from vitrain.config import load_config
    from vitrain.models import PRESETS, find_preset

    presets = [p for p in PRESETS.values() if not p.stages]  # MViTv2's stages are not modelled here
    if first is not None:
        start = find_preset(first)
        if start is None:
            raise ConfigError(f"preset {first} is unknown; `vitrain models` lists them")
        if start.stages:
            raise ConfigError(mvit_refusal(start.name))
        presets = [p for p in presets[presets.index(start) :] if p.is_video == start.is_video]
    return {
        p.alias: load_config(base={"model": {"preset": p.name, **{k: v for k, v in fields.items() if v}}}).model
        for p in presets
    }


def table(device_gib: float, models: dict[str, ModelConfig], **kwargs) -> str:
    """One line per model: per-device GiB under the given setting and the devices of `device_gib` it needs."""
    lines = [
        f"{'preset':<13}{'params':>16}{'states GiB':>12}{'activ. GiB':>12}{'train GiB':>11}{'build GiB':>11}"
        f"{'peak GiB':>10}{'host GiB':>10}{f'devices@{device_gib:g}GiB':>17}"
    ]
    others = {k: v for k, v in kwargs.items() if k != "devices"}
    for alias, cfg in models.items():
        est = estimate(cfg, **kwargs)
        need = devices_needed(cfg, int(device_gib * 2**30), **others)
        lines.append(
            f"{alias:<13}{config_complexity(cfg).params:>16,}{_gib(est.model_states):>12}{_gib(est.activations):>12}"
            f"{_gib(est.total):>11}{_gib(est.build):>11}{_gib(est.peak):>10}{_gib(est.host_bytes):>10}"
            f"{need if need else 'never':>17}"
        )
    return "\n".join(lines)


def grid(device_counts: list[int], memories_gib: list[float], models: dict[str, ModelConfig], **kwargs) -> str:
    """Per-device peak GiB of each model on each number of devices, marked with the smallest memory it fits."""
    marks = sorted(memories_gib)
    lines = [f"{'preset':<13}{'params':>9}" + "".join(f"{f'{n} devices':>16}" for n in device_counts)]
    for alias, cfg in models.items():
        cells = []
        for n in device_counts:
            peak = estimate(cfg, devices=n, **kwargs).peak
            fits = next((f"{m:g}" for m in marks if peak <= m * 2**30), "-")
            cells.append(f"{_gib(peak):>9} {fits:>6}")
        lines.append(f"{alias:<13}{config_complexity(cfg).params / 1e9:>8.2f}B" + "".join(cells))
    memories = ", ".join(f"{m:g}" for m in marks)
    lines.append(f"each cell: peak GiB per device, then the smallest of {memories} GiB it fits in (-: none)")
    return "\n".join(lines)


def breakdown(cfg: ModelConfig, device_gib: float, **kwargs) -> str:
    """The terms of one estimate, one per line, and the devices of `device_gib` it needs."""
    est = estimate(cfg, **kwargs)
    rows = [
        ("weights", est.weights),
        ("gradients", est.gradients),
        ("optimizer states", est.optimizer),
        ("fp32 master copy", est.master),
        ("fp32 master gradients", est.master_gradients),
        ("EMA weights (fp32)", est.ema),
        ("FSDP units in flight", est.gathered),
        ("activations", est.activations),
        ("total in training", est.total),
        ("whole-model build", est.build),
        ("process baseline", est.baseline),
        ("peak per device", est.peak),
        ("offloaded to host", est.host_bytes),
    ]
    lines = [f"{name:<22}{_gib(value):>10} GiB" for name, value in rows]
    if cfg.num_frames > 1:  # a video model: what its activations are counted over
        size, p = cfg.image_size, cfg.patch_size
        lines.insert(0, f"tokens per clip {cfg.num_patches:,} = {cfg.num_frames}/{cfg.tubelet_size} frames x "
                        f"{size}/{p} x {size}/{p} patches; batch counts clips")  # fmt: skip
    others = {k: v for k, v in kwargs.items() if k != "devices"}
    need = devices_needed(cfg, int(device_gib * 2**30), **others)
    none = "none suffice (shard with zero3)"
    if cfg.name == "mvit":  # whole weights only in this model
        none = f"none suffice with whole weights: a smaller batch, or measure other layouts with `{mvit_bench(cfg)}`"
    lines.append(f"devices of {device_gib:g} GiB needed: {need if need else none}")
    return "\n".join(lines)


def largest(device_gib: float, base: dict, **kwargs) -> str:
    """The largest model on the presets' proportions (`ladder`) whose peak fits in `device_gib`, and its terms."""
    models = ladder(base)
    i = largest_that_fits(models, int(device_gib * 2**30), **kwargs)
    if i is None:
        return f"no model on the presets' proportions fits in {device_gib:g} GiB per device"
    m = models[i]
    head = (
        f"largest on the presets' proportions in {device_gib:g} GiB: width {m.width}, depth {m.depth}, "
        f"heads {m.heads}, mlp {m.hidden_dim}: {complexity(m).params:,} params"
    )
    return head + "\n" + breakdown(m, device_gib, **kwargs)
