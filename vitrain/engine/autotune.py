"""Autotune: `auto` config values decided by timing a few real training steps of each candidate on this device.

    decision = autotune(cfg, device)   # None when nothing is auto (or VITRAIN_AUTOTUNE=0)
    decision.values                    # {"precision.mode": "fp32", "model.attention": "sdpa"}

What is tuned, and among what:
- `precision.mode=auto` (native engine, strategy single/ddp/zero1, no pipeline stages): fp32, bf16 amp_o1 and bf16
  amp_o2, where the device computes bf16. Pure and fp16 are never candidates: they are picked only when asked for.
  On a CPU whose bf16 matmul measures over 3x slower than its fp32 one (bf16 emulated, as on an AVX2 Zen 3) the
  bf16 candidates are not run, and say why (unless fp32 would not fit in memory).
  Under zero2/zero3 and pipelines auto keeps its rules in vitrain/precision.py.
- `model.attention=auto`: sdpa and manual (the same weights and function; different kernels): where each device
  holds the whole model (single/ddp/zero1) on one device, and under the native engine's zero2/zero3 under the run's
  own sharding over every rank, with the FSDP unit; with pipeline stages and DeepSpeed's zero2/zero3 it is sdpa.
- `parallel.wrap=auto` (native engine, zero2/zero3, no pipeline stages): the FSDP unit, the whole model, each block or
  each block's attention and MLP, timed under the run's own strategy over every rank (the units decide how many
  collectives a step makes and how much of the model is gathered at once); under zero3 the whole model is no
  candidate (it would gather every parameter at once, the memory zero3 is chosen to save). Where it does not run:
  the whole model under zero2, each block under zero3 (vitrain/models/plan.py auto_wrap); a unit timed within 3% of
  the fastest that is the rule's is kept (a race of a few steps cannot tell such units apart).

Each candidate is the run's own training step (vitrain/engine/step.py) over a native engine set up for it: the
run's model built by its task from the candidate's config (the attention kernel is a config value, not a patch),
the task's head and loss, the run's optimizer, on the run's first batch; one device per process (the strategy's
wrapper and its communication are left out alike for every candidate), except under zero2/zero3, where every
candidate runs under the run's own sharding (one device may not hold the whole model, and the collectives are part of
what a kernel's choice costs there). Every rank runs the race in lockstep (a
task's loss may be collective, as the face head's is) and each step counts at its slowest rank, so every rank makes
the same choices; rank 0 reads and writes the cache. Two warm-up steps, then up to `steps` timed ones, the
candidates taking turns; one whose better of its first two timed steps is 1.5x slower than the best's is dropped (a
single step can meet a passing load: one is not enough to judge; where steps take seconds, one whose warm-up step
takes 2x the best one's already), one whose step goes inf/NaN is dropped however fast (where all do, the run
stops: TrainingDiverged), and one that the memory estimate says cannot fit on the device is not run. The best
step of each counts; the fastest wins. Every combination of the keys' values is a candidate: they interact. The
decision, its figures and its reason are cached per device, torch, threads and shape (`$VITRAIN_CACHE_DIR`,
default ~/.cache/vitrain/autotune), so a second run does not pay.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import hashlib
import itertools
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vitrain.config import Config, PrecisionConfig, to_dict
from vitrain.device import LOW_DTYPES, available_bytes, bf16_emulated, cpu_description, synchronize
from vitrain.engine.native import NativeEngine
from vitrain.engine.step import TrainStep
from vitrain.engine.token_drop import TokenDrop
from vitrain.errors import ConfigError
from vitrain.files import atomic_write
from vitrain.models.memory import estimate
from vitrain.models.plan import auto_wrap
from vitrain.parallel.distributed import DistInfo, all_or_none, broadcast_object, max_over_ranks
from vitrain.parallel.overlap import deferrable
from vitrain.precision import (
    SHARDED,
    CompiledFp32LayerNorm,
    Resolved,
    TrainingDiverged,
    compiles_norms,
)
from vitrain.tasks import teacher_of

TUNE_ENV = "VITRAIN_AUTOTUNE"  # 0: auto values follow the fixed rules (precision by capability, sdpa attention)
CACHE_ENV = "VITRAIN_CACHE_DIR"
PRECISION_STRATEGIES = ("single", "ddp", "zero1")
WRAPS = ("model", "block", "sublayer")
PRUNE_RATIO = 1.5
RULE_MARGIN = 1.03  # an FSDP unit timed within 3% of the fastest: the rule's unit is kept (_rule_within_noise)
WARMUP_DROP_RATIO = 2.0
SLOW_STEP_S = 5.0  # a warm-up step longer than this: one timed step per candidate instead of `steps`


class _NonFinite(Exception):
    """A candidate's step went inf/NaN in its loss or gradients: not safe for this model here, whatever its speed."""


class _Stopping(Exception):
    """A stop signal came during the race (`autotune`'s `stop`): the race ends, deciding nothing."""


@dataclass
class Decision:
    values: dict[str, str]  # config key -> the value auto became
    images_per_s: dict[str, float]  # candidate label -> measured images/s (0.0: not run or dropped)
    notes: dict[str, str]  # candidate label -> why it was dropped or not run
    reason: str
    cached_at: str = ""  # where the decision is cached (a hit: read from there)
    from_cache: bool = False
    machine: dict[str, Any] = dataclasses.field(default_factory=dict)  # where it was measured (machine_of)
    step: str = ""  # the timed step's cache key (cache_path's file name without .json); "": written before it was kept

    def precision(self, cfg: PrecisionConfig) -> Resolved | None:
        mode = self.values.get("precision.mode")
        if mode is None:
            return None
        dtype = torch.float32 if mode == "fp32" else LOW_DTYPES[cfg.dtype]
        return Resolved(mode, dtype, self.reason)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def enabled() -> bool:
    return os.environ.get(TUNE_ENV, "1") != "0"


def candidates(cfg: Config, device: torch.device, pipelined: bool) -> dict[str, list[str]]:
    """The values each auto key may take on this device and run; empty when nothing is tuned."""
    tuned: dict[str, list[str]] = {}
    # Where the run holds a whole replica per device, candidates are whole models on one device; under the native
    # zero2/zero3 they run under the run's own sharding (_Race). With pipeline stages and DeepSpeed's zero2/zero3, auto
    # keeps its rules (precision in vitrain/precision.py, sdpa attention).
    replicated = cfg.parallel.strategy in PRECISION_STRATEGIES and not pipelined
    sharded = cfg.parallel.strategy in SHARDED and not pipelined and cfg.train.engine == "native"
    if replicated and cfg.precision.mode == "auto" and cfg.train.engine == "native" and _computes_bf16(device):
        tuned["precision.mode"] = ["fp32", "amp_o1", "amp_o2"]
    if (replicated or sharded) and cfg.model.attention == "auto":
        tuned["model.attention"] = ["sdpa", "manual"]
    if sharded and cfg.parallel.wrap == "auto":
        # zero3 is chosen to hold one unit's parameters at a time: a single unit would hold them all.
        tuned["parallel.wrap"] = [w for w in WRAPS if cfg.parallel.strategy == "zero2" or w != "model"]
    return tuned


def _computes_bf16(device: torch.device) -> bool:
    return device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_bf16_supported())


def autotune(
    cfg: Config,
    task: Any,
    dist: DistInfo,
    sample: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    pipelined: bool = False,
    steps: int = 3,
    stop: Callable[[], bool] | None = None,
    kept: Path | None = None,
) -> Decision | None:
    """Collective: time the candidates of every auto key (or read rank 0's cached decision); None when nothing is
    tuned. `task` is the run's, its data built (a head such as the face task's needs its identities); `sample()`
    gives the batch every candidate steps on (the run's first one). `stop` (collective, the same answer on every
    rank) is asked after each round of the race: where it says True the race ends there, and autotune returns None
    and caches nothing (the trainer's stop signals: a preempted run stops before its first step). `kept`: a resumed
    run's autotune.json, whose values hold where they were measured on this machine (the same kernels, so the resume
    continues bit for bit); on another machine the race runs again."""
    device = dist.device
    options = candidates(cfg, device, pipelined)
    if not options or not enabled():
        return None
    machine = machine_of(dist)
    path = cache_path(cfg, device, options)
    if kept is not None:  # a resume: the run's own decision where it was measured on this machine, for this shape
        with all_or_none("reading the run's autotune.json"):
            previous = _read_cache(kept) if dist.is_main else None
        previous = broadcast_object(previous)
        chosen = _still_valid(previous, options, machine, path)  # each rank against its own machine; all must agree
        if previous is not None and max_over_ranks(float(chosen is None), device) == 0.0:
            return chosen
    with all_or_none("reading the autotune cache"):
        cached = _read_cache(path) if dist.is_main else None
    cached = broadcast_object(cached)
    if cached is not None:
        cached.machine, cached.step = machine, path.stem  # measured on a machine like this one (the cache's key)
        return cached
    available = broadcast_object(available_bytes(device))  # rank 0's: every rank decides alike
    fits, need = _memory_check(cfg, available)
    emulated = None
    if "precision.mode" in options:
        emulated = broadcast_object(bf16_emulated(device) if dist.is_main else None)
    seconds: dict[str, float] = {}
    notes: dict[str, str] = {}
    rounds: list[str] = []
    # Every combination: the keys interact (on a CPU sdpa's bf16 backward is slow while manual attention gains from
    # bf16, so precision judged under one kernel can pick the wrong pair). Slow candidates leave the race early.
    labels: dict[str, dict[str, str]] = {}
    for combination in itertools.product(*options.values()):
        values = dict(zip(options, combination, strict=True))
        label = _label(values)
        mode = values.get("precision.mode")
        if mode is not None and (reason := fits(mode)):
            notes[label] = reason
        elif mode in ("amp_o1", "amp_o2") and emulated and fits("fp32") is None:  # slow, but not the only one
            notes[label] = f"not raced: {emulated}"
        else:
            labels[label] = values
    if not labels:  # the memory estimate left no candidate to run at all
        raise ConfigError(f"autotune: no candidate can run here: {'; '.join(f'{k}: {v}' for k, v in notes.items())}")
    # Taking turns keeps every candidate in memory at once: where they would not all fit (or on a GPU, where a
    # run fills the memory and timings are steadier), one at a time instead. The processes of a node share it.
    together = sum(need(values.get("precision.mode")) for values in labels.values())
    together *= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    interleave = broadcast_object(device.type == "cpu" and (available is None or together < available))
    with torch.random.fork_rng(devices=[]):  # the run's own random stream is left where it was
        batch = sample()
        if stop is not None and stop():  # also where the batch's read failed for the stop signal (the trainer's)
            return None
        race = _Race(cfg, task, dist, batch, stop)
        try:
            values = _race(race, labels, steps, seconds, notes, rounds, interleave)
        except _Stopping:
            return None
    values, kept = _rule_within_noise(values, seconds, cfg)
    batch = cfg.train.batch_size
    images_per_s = {label: batch / s for label, s in seconds.items()}
    measured = "; ".join(rounds)
    skipped = "".join(f"; {label}: {note}" for label, note in notes.items() if label not in seconds)
    where = "GPU " + torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_description().split(";")[0]
    chosen = ", ".join(f"{k}={v}" for k, v in values.items())
    processes = f" x {dist.world_size} processes" if dist.world_size > 1 else ""
    reason = (
        f"autotune ({where}, {torch.get_num_threads()} thread(s){processes}, batch {batch}, candidates taking turns, "
        f"best step each): {measured}{skipped} -> {kept or 'the fastest: '}{chosen}"
    )
    decision = Decision(values, images_per_s, notes, reason, cached_at=str(path), machine=machine, step=path.stem)
    if dist.is_main:
        _write_cache(path, decision)
    return decision


class _Race:
    """Builds a candidate's step: a native engine (one device per process) over the task's model and head as the
    candidate's config builds them, and the run's training step over one fixed batch; times one step of it."""

    def __init__(
        self,
        cfg: Config,
        task: Any,
        dist: DistInfo,
        batch: tuple[torch.Tensor, torch.Tensor],
        stop: Callable[[], bool] | None = None,
    ):
        self.cfg, self.task, self.dist, self.device = cfg, task, dist, dist.device
        self.batch = [batch]
        self.norms_compiled = False  # an amp_o2 candidate's compiled norms have stepped once in this race
        self.stop = stop

    def round_done(self) -> None:
        """Collective, between rounds (every rank runs the same rounds): raise _Stopping where `stop` says so."""
        if self.stop is not None and self.stop():
            raise _Stopping

    def candidate(self, values: dict[str, str]) -> Callable[[], float]:
        cfg = self.cfg
        if cfg.parallel.strategy in SHARDED:  # raced under the run's own sharding, over every rank
            parallel = dataclasses.replace(cfg.parallel, wrap=values.get("parallel.wrap", cfg.parallel.wrap))
        else:
            parallel = dataclasses.replace(cfg.parallel, strategy="single", pipeline_stages=1)
        cfg = dataclasses.replace(
            cfg,
            precision=dataclasses.replace(cfg.precision, mode=values.get("precision.mode", cfg.precision.mode)),
            model=dataclasses.replace(cfg.model, attention=values.get("model.attention", cfg.model.attention)),
            parallel=parallel,
        )
        task = copy.copy(self.task)  # the run's task (its data), building the candidate's model and head
        task.cfg = cfg
        model = task.build_model()
        if model is getattr(self.task, "model", None):  # a module handed to the library: never stepped in place
            model = copy.deepcopy(model)
        model = model.to(self.device)
        head = task.build_head(self.device)
        engine = NativeEngine(cfg, model, self.dist, head=head)
        step = TrainStep(engine, task.loss, 1, TokenDrop.from_config(cfg, self.dist.rank), teacher_of(task, engine))
        engine.set_lr(cfg.optim.lr)
        compiles = not self.norms_compiled and any(
            isinstance(m, CompiledFp32LayerNorm) for m in engine.forward.modules()
        )
        if max_over_ranks(float(compiles), self.device):  # every rank steps (a sharded step is collective)
            # amp_o2 raced with the norms the run would compile (precision.compile_norms), their compile (seconds,
            # once per process: later candidates and the run's own step reuse it; the candidates share the norms'
            # shapes) in an untimed step before the first one's warm-up steps.
            if max_over_ranks(float(not _finite(step, self.batch)), self.device):
                raise _NonFinite
            self.norms_compiled = True

        def run() -> float:
            start = time.perf_counter()
            finite = _finite(step, self.batch)
            synchronize(self.device)
            # Every rank learns whether any went inf/NaN in the same collective that takes the slowest rank's time:
            # under ddp/zero1 each candidate decides its skips alone, on its rank's own first batch.
            elapsed = max_over_ranks(time.perf_counter() - start if finite else math.inf, self.device)
            if math.isinf(elapsed):
                raise _NonFinite
            return elapsed

        return run


def _finite(step: TrainStep, batch: list) -> bool:
    """One step of a candidate; False where its loss or gradients went inf/NaN on this rank (the engine skipped the
    step, or stopped at precision.max_nonfinite_skips)."""
    try:
        return not step(batch).skipped
    except TrainingDiverged:
        return False


NONFINITE = "dropped: its loss or gradients went inf/NaN (not safe for this model here)"


def _unless_nonfinite(label: str, attempt: Callable[[], Any], notes: dict[str, str]) -> Any:
    """attempt()'s result, or None (and why, in `notes`) where the candidate's step went inf/NaN on some rank."""
    try:
        return attempt()
    except _NonFinite:
        notes[label] = NONFINITE
        return None


def _rule_within_noise(values: dict[str, str], seconds: dict[str, float], cfg: Config) -> tuple[dict[str, str], str]:
    """The FSDP unit the rule gives (auto_wrap) where it timed within RULE_MARGIN of the fastest: a race of a few
    steps cannot tell units that close apart, and the rule's is the one measured over whole benchmarks
    (docs/performance.md). The other values raced with it (the attention kernel) stay the fastest's. Returns the
    values to keep and, where the rule's unit was kept, why."""
    if "parallel.wrap" not in values:
        return values, ""
    rule = {**values, "parallel.wrap": auto_wrap(cfg.parallel.strategy)}
    fastest, ruled = seconds.get(_label(values)), seconds.get(_label(rule))
    if values == rule or fastest is None or ruled is None or ruled > RULE_MARGIN * fastest:
        return values, ""
    return rule, f"within {RULE_MARGIN - 1:.0%} of the fastest ({_label(values)}), the rule's unit: "


def _race(
    race: _Race,
    labels: dict[str, dict[str, str]],
    steps: int,
    seconds: dict[str, float],
    notes: dict[str, str],
    rounds: list[str],
    interleave: bool = True,
) -> dict[str, str]:
    """Time the candidates round-robin (a passing load slows each alike); returns the fastest's values.

    Warm-up: two steps each (allocator and kernel caches settle after the first); where a step is slow (over
    SLOW_STEP_S), one, after which a candidate over WARMUP_DROP_RATIO x the best is dropped. Then `steps` timed
    rounds (one where slow), dropping after the second round any candidate whose better step is over PRUNE_RATIO x
    the best's (one round is not enough: a passing load can land on a single step of the fastest).
    Without `interleave`, each candidate's steps run before the next one is built, and none is dropped for its speed.
    Under either, a candidate whose step goes inf/NaN is dropped at that step.
    """
    if not interleave:
        return _one_at_a_time(race, labels, steps, seconds, notes, rounds)
    runs: dict[str, Callable[[], float]] = {}
    first: dict[str, float] = {}
    for label, values in labels.items():
        run = _unless_nonfinite(label, functools.partial(race.candidate, values), notes)
        if run is not None and (step_s := _unless_nonfinite(label, run, notes)) is not None:
            runs[label], first[label] = run, step_s
    race.round_done()
    _some_finite(first, race.cfg)
    slow = max(first.values()) > SLOW_STEP_S
    for label in list(runs):  # slow steps: a first step twice the best one's is not worth timing further
        if slow and first[label] > WARMUP_DROP_RATIO * min(first.values()):
            notes[label] = f"dropped after its warm-up step: over {WARMUP_DROP_RATIO}x the best"
            del runs[label]
    if not slow:
        for label, run in list(runs.items()):
            if _unless_nonfinite(label, run, notes) is None:
                del runs[label]
        race.round_done()
    times: dict[str, list[float]] = {label: [] for label in runs}
    for round_ in range(1 if slow else steps):
        for label, run in list(runs.items()):
            if (step_s := _unless_nonfinite(label, run, notes)) is None:
                del runs[label], times[label]
            else:
                times[label].append(step_s)
        race.round_done()
        if not runs:  # the rest went inf/NaN: the fastest finite one dropped for its speed wins below
            break
        if round_ == 1:
            best = min(min(t) for t in times.values())
            for label in list(runs):
                if min(times[label]) > PRUNE_RATIO * best:
                    notes[label] = f"dropped after two timed steps: over {PRUNE_RATIO}x the best"
                    del runs[label]
    # Dropped at warm-up: that step; a candidate that went inf/NaN counts nowhere (its note says why).
    measured = {label: first[label] for label in notes if label in first and notes[label] != NONFINITE}
    measured.update({label: min(t) for label, t in times.items()})
    _some_finite(measured, race.cfg)
    seconds.update(measured)
    warmups = 1 if slow else 2
    timed = 1 if slow else steps
    batch = race.cfg.train.batch_size
    rounds.append(
        f"{warmups} warm-up + {timed} timed step(s): "
        + ", ".join(
            f"{label} {batch / t:.1f} img/s" + (" (dropped)" if label in notes else "") for label, t in measured.items()
        )
    )
    # The fastest still racing; where every one of those went inf/NaN, the fastest finite one dropped for speed.
    finishers = [label for label in measured if label not in notes] or list(measured)
    return labels[min(finishers, key=measured.get)]


def _one_at_a_time(
    race: _Race,
    labels: dict[str, dict[str, str]],
    steps: int,
    seconds: dict[str, float],
    notes: dict[str, str],
    rounds: list[str],
) -> dict[str, str]:
    measured = {}
    for label, values in labels.items():

        def timed(values: dict[str, str] = values) -> float:
            run = race.candidate(values)
            slow = run() > SLOW_STEP_S
            if not slow:
                run()
            return min(run() for _ in range(1 if slow else steps))

        if (best := _unless_nonfinite(label, timed, notes)) is not None:
            measured[label] = best
        race.round_done()
        gc.collect()
        if race.device.type == "cuda":
            torch.cuda.empty_cache()
    _some_finite(measured, race.cfg)
    seconds.update(measured)
    batch = race.cfg.train.batch_size
    why = "a GPU times each alone" if race.device.type == "cuda" else "they would not all fit at once"
    rounds.append(
        f"one candidate at a time ({why}): "
        + ", ".join(f"{label} {batch / t:.1f} img/s" for label, t in measured.items())
    )
    return labels[min(measured, key=measured.get)]


def _some_finite(left: dict[str, Any], cfg: Config) -> None:
    """TrainingDiverged where every candidate's step went inf/NaN: no precision or kernel is safe at this lr."""
    if not left:
        raise TrainingDiverged(
            f"autotune: every candidate's loss or gradients went inf/NaN in its steps on the run's first batch at "
            f"optim.lr={cfg.optim.lr:g}: lower optim.lr (or set precision.mode and model.attention to skip the race)"
        )


def _norms_compiled(cfg: Config, device: torch.device) -> bool:
    """Whether an amp_o2 candidate of `cfg` computes its norms compiled (False where no candidate can be amp_o2)."""
    if cfg.precision.mode not in ("auto", "amp_o2"):
        return False
    return compiles_norms(cfg.precision.compile_norms, device)


def _label(values: dict[str, str]) -> str:
    """A candidate's name in the log: `amp_o2 bf16 + manual`, `wrap=block`."""
    mode, attention, wrap = (values.get(k) for k in ("precision.mode", "model.attention", "parallel.wrap"))
    parts = (mode and f"{mode}{'' if mode == 'fp32' else ' bf16'}", attention, wrap and f"wrap={wrap}")
    return " + ".join(part for part in parts if part)


def _memory_check(cfg: Config, available: int | None) -> tuple[Callable[[str], str | None], Callable[[str], int]]:
    """(mode -> why it cannot fit in `available` bytes by the memory estimate or None, mode -> its estimated bytes)."""

    def need(mode: str | None) -> int:
        precision = "bf16" if mode == "amp_o2" else "fp32"
        return estimate(cfg.model, 1, "single", batch=cfg.train.batch_size, precision=precision).total

    def fits(mode: str) -> str | None:
        bytes_needed = need(mode)
        if available is not None and bytes_needed > available:
            return (
                f"not run: the memory estimate {bytes_needed / 2**30:.1f} GiB exceeds {available / 2**30:.1f} GiB "
                "available"
            )
        return None

    return fits, need


def cache_path(cfg: Config, device: torch.device, options: dict[str, list[str]]) -> Path:
    """Where the decision for this device, torch, thread count and run shape is kept."""
    model = to_dict(cfg)["model"]
    for key in ("attention", "init_from", "inflate_from", "inflate", "preset"):
        model.pop(key, None)
    key = {
        "device": _device_name(device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "model": model,
        "task": cfg.task.name,
        "embed_dim": cfg.task.embed_dim if cfg.task.name == "face" else 0,
        "batch": cfg.train.batch_size,
        "optim": [cfg.optim.name, cfg.optim.impl],
        # A fixed precision times attention under that precision: each its own decision. amp_o2 races with its
        # norms compiled or not (precision.compile_norms as this device resolves it).
        "precision": [cfg.precision.mode, cfg.precision.dtype, _norms_compiled(cfg, device)],
        "options": options,
    }
    # What else the raced step holds (engine/step.py), where a run sets it: activation checkpointing recomputes
    # forwards, token dropping shortens the sequence, a teacher adds its forward. Absent at their defaults, so that
    # the decisions of plain runs keep their keys.
    step = {
        "activation_checkpointing": (
            [cfg.parallel.activation_checkpointing, cfg.parallel.checkpoint_every_k]
            if cfg.parallel.activation_checkpointing != "none"
            else None
        ),
        "token_drop": cfg.train.token_drop or None,
        "teacher": (
            [cfg.train.distill.teacher, cfg.train.distill.teacher_weights, cfg.train.distill.type]
            if cfg.train.distill.teacher
            else None
        ),
    }
    key |= {name: value for name, value in step.items() if value is not None}
    if cfg.parallel.strategy in SHARDED:  # raced over every rank: the sharding and the ranks are part of the shape
        key["parallel"] = [
            cfg.parallel.strategy,
            os.environ.get("WORLD_SIZE", "1"),
            cfg.parallel.offload,
            cfg.parallel.wrap,
            # FSDP2's collectives beside compute or blocking (vitrain/parallel/overlap.py): another race
            "overlap" if deferrable(cfg) else "blocking",
            cfg.parallel.grad_reduce,
        ]
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "vitrain") / "autotune"
    return root / f"{digest}.json"


KEPT = "autotune: this run's own decision on this machine, kept on resume"


def _device_name(device: torch.device) -> str:
    """The GPU's model, or the CPU's description (its kind and matrix units): the cache key's and machine_of's."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_description()


def machine_of(dist: DistInfo) -> dict[str, Any]:
    """What a decision's timings depend on beside the run's config: the device, torch, threads and processes."""
    threads, processes = torch.get_num_threads(), dist.world_size
    return {"device": _device_name(dist.device), "torch": torch.__version__, "threads": threads, "processes": processes}


def _still_valid(
    previous: Decision | None, options: dict[str, list[str]], machine: dict[str, Any], path: Path
) -> Decision | None:
    """A resumed run's earlier decision, for the keys still auto, where it was measured on this machine for the step
    the run takes now (its cache key, `path`'s name: a resume that changes the batch, optimizer, model or sharding
    times another step; a decision written before the key was kept holds as before) and each of its values is still
    a candidate here; else None (race again). A decision written before machines were recorded, or changed by hand to
    a value not among the candidates, is raced again."""
    if previous is None or previous.machine != machine or previous.step not in ("", path.stem):
        return None
    if any(previous.values.get(key) not in values for key, values in options.items()):
        return None
    values = {key: previous.values[key] for key in options}
    chosen = ", ".join(f"{k}={v}" for k, v in values.items())
    measured = previous.reason.partition("); ")[2] if previous.reason.startswith(KEPT) else previous.reason
    reason = f"{KEPT} ({chosen}); {measured}"
    return dataclasses.replace(previous, values=values, reason=reason, machine=machine)


def _read_cache(path: Path) -> Decision | None:
    if not path.exists():
        return None
    try:
        decision = Decision(**json.loads(path.read_text()))
    except (ValueError, TypeError):
        return None  # a damaged cache entry is measured again and rewritten
    texts = lambda d: isinstance(d, dict) and all(isinstance(k, str) for k in d)  # noqa: E731
    if not (
        texts(decision.values)
        and all(isinstance(v, str) for v in decision.values.values())
        and texts(decision.images_per_s)
        and texts(decision.notes)
        and isinstance(decision.reason, str)
        and texts(decision.machine)
        and isinstance(decision.step, str)
    ):
        return None  # the same for a file of the right keys and the wrong kinds (a run's autotune.json, hand-edited)
    decision.from_cache, decision.cached_at = True, str(path)
    return decision


def _write_cache(path: Path, decision: Decision) -> None:
    try:
        atomic_write(path, (json.dumps(decision.to_json(), indent=2) + "\n").encode())
    except OSError:
        pass  # no writable cache: the next run measures again
