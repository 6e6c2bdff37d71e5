"""The training loop: data in; metrics, checkpoints and a summary out. Reads top to bottom."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from vitrain import checkpoint as ckpt
from vitrain.config import Config, config_from_dict, to_dict, to_yaml
from vitrain.data.augment import progressive_size, resize_batch
from vitrain.data.loader import WaitTimer
from vitrain.engine.engines import build_engine
from vitrain.engine.runs import choose_run, mark_run
from vitrain.errors import CheckpointError, ConfigError
from vitrain.optim import Schedule, resolve_impl, scaled_lr
from vitrain.parallel import broadcast_object, init_distributed, mean_over_ranks, unwrap
from vitrain.parallel.distributed import RUN_DIR_KEY, all_or_none, launch_store, restart_count
from vitrain.parallel.pipeline import Pipeline
from vitrain.precision import time_block_modes
from vitrain.tasks import build_task, is_better
from vitrain.weights import load_pretrained


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"train.device={name} is not a device; use auto, cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is available; use train.device=auto or cpu")
    return device


class RunLog:
    """Human lines to stderr and log.txt; machine records to metrics.jsonl. Silent on ranks other than 0."""

    def __init__(self, run_dir: Path, enabled: bool = True, tensorboard: bool = False):
        self.enabled = enabled
        self.events = None
        if enabled:
            self.text = open(run_dir / "log.txt", "a")
            self.jsonl = open(run_dir / "metrics.jsonl", "a")
            if tensorboard:
                self.events = tensorboard_writer(run_dir / "tensorboard")

    def info(self, message: str) -> None:
        if not self.enabled:
            return
        tqdm.write(message, file=sys.stderr)
        self.text.write(message + "\n")
        self.text.flush()

    def record(self, **fields: Any) -> None:
        if not self.enabled:
            return
        self.jsonl.write(json.dumps(fields) + "\n")
        self.jsonl.flush()
        if self.events is not None:  # the step is the x axis; each other number a scalar (eval ones under val/)
            step = fields.get("step", 0)
            for name, value in fields.items():
                if name not in ("step", "epoch") and isinstance(value, int | float) and not isinstance(value, bool):
                    group = "val" if name.startswith(("val_", "ema_val_")) else "train"
                    self.events.add_scalar(f"{group}/{name}", value, step)
            self.events.flush()

    def close(self) -> None:
        if self.enabled:
            self.text.close()
            self.jsonl.close()
            if self.events is not None:
                self.events.close()
            self.enabled = False


def tensorboard_writer(folder: Path):
    """torch's SummaryWriter (it needs the tensorboard package; log.tensorboard=true says how to get it)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(
            "log.tensorboard=true needs the tensorboard package: pip install 'vitrain[tensorboard]' "
            "(or set log.tensorboard=false; `vitrain plot RUN` draws the curves without it)"
        ) from None
    return SummaryWriter(log_dir=str(folder))


class Trainer:
    """Builds everything from one config, then `fit()` trains, evaluates, checkpoints and summarizes."""

    def __init__(self, cfg: Config, resume: bool | str = False):
        # The run's wall clock (train.time_limit_s, wall_s): setup and data decoding count.
        self.started = time.perf_counter()
        self.cfg = cfg
        self.run_dir = cfg.run_dir
        torch.manual_seed(cfg.train.seed)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        self.dist = init_distributed(resolve_device(cfg.train.device), cfg.parallel.strategy, cfg.parallel.backend)
        self.device = self.dist.device
        self.is_main = self.dist.is_main
        self.notes: list[str] = []  # what choosing the run folder and loading did, logged once the log is open
        self.resume_path = self._choose_run(resume)

        t = cfg.train
        # auto values (precision, attention) decided by timing this run's own step on rank 0 (vitrain/bench/tune.py).
        self.tuned = self._autotune(cfg)
        if self.tuned is not None and "model.attention" in self.tuned.values:
            attention = self.tuned.values["model.attention"]
            cfg = self.cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention=attention))
        # The task owns data, head, loss, evaluation and the best metric (vitrain/tasks).
        self.task = build_task(cfg)
        # Pipelining: a (pipeline x data) mesh whose stages of one replica read the same batches.
        self.pipeline = Pipeline(cfg.parallel, self.dist, self.task.loss) if cfg.parallel.pipeline_stages > 1 else None
        if self.pipeline is not None:
            self.dist = self.pipeline.dist
        self.train_loader = self.task.build_data(self.device, self.dist.data_rank, self.dist.data_size)
        self.steps_per_epoch = len(self.train_loader) // t.accum_steps
        if self.steps_per_epoch == 0:
            raise ConfigError(
                f"train.batch_size={t.batch_size} x train.accum_steps={t.accum_steps} is larger than the "
                f"{len(self.train_loader.data)} training samples; lower the batch size"
            )
        self.total_steps = self.steps_per_epoch * t.epochs
        peak_lr = scaled_lr(cfg.optim.lr, cfg.schedule, t.batch_size * t.accum_steps * self.dist.data_size)
        self.schedule = Schedule(cfg.schedule, peak_lr, self.total_steps, self.steps_per_epoch)

        # parallel.sharded_init: built on the meta device, then the strategy draws this rank's shards of the
        # same weights (vitrain/parallel/materialize.py).
        with torch.device("meta") if cfg.parallel.sharded_init else contextlib.nullcontext():
            model = self.task.build_model()  # the same initial weights on every rank (seed)
        if cfg.model.init_from:
            load_pretrained(model, Path(cfg.model.init_from))
        if self.pipeline is not None:  # this rank's stages only, before they take device memory
            model = self.pipeline.split(model)
        if not cfg.parallel.sharded_init:
            model = model.to(self.device)
        # Dropout and drop-path draw from seed + rank: each rank masks its own samples differently. Data order
        # and augmentation have their own generators, functions of (seed, epoch, batch, rank).
        torch.manual_seed(cfg.train.seed + self.dist.rank)
        # Parameters outside the backbone (the face task's identity head): fp32, this rank's rows, own optimizer.
        self.head = self.task.build_head(self.device)
        # The engine (train.engine) sets up precision, parallelism and the optimizers, and owns backward, step,
        # save and load; the trainer talks only to it for those (vitrain/engine/engines.py).
        self.engine = build_engine(
            cfg,
            model,
            self.dist,
            head=self.head,
            pipeline=self.pipeline,
            time_modes=lambda: self._time_modes(model),
            precision=self.tuned.precision(cfg.precision) if self.tuned is not None else None,
        )
        self.model = self.engine.model  # the single-device model: parameter names, complexity
        self.forward = self.engine.forward  # what computes the loss and the evaluation
        # The native engine's parts, which tools and tests reach through the trainer.
        self.precision = getattr(self.engine, "precision", None)
        self.optimizer = getattr(self.engine, "optimizer", None)
        self.head_optimizer = getattr(self.engine, "head_optimizer", None)

        self.step = 0
        self.epoch = 0
        self.epoch_batches: Any = None  # the current epoch's batch iterator
        self.batch_in_epoch = 0  # micro-batches of the current epoch already consumed
        self.best_metric: float | None = None  # the task's best_metric at the best evaluation so far
        self.last_eval: dict[str, Any] = {}
        self.last_eval_s = 0.0  # how long the last evaluation took: train.time_limit_s leaves room for one more
        self.setup_s: float | None = None  # wall_s when training began (the first step of the run, across resumes)

    def _autotune(self, cfg: Config):
        """Rank 0 times the candidates of the config's auto values (or reads them cached); every rank follows."""
        from vitrain.bench.tune import autotune

        decision = None
        with all_or_none("autotuning the auto config values"):
            if self.is_main:
                pipelined = cfg.parallel.pipeline_stages > 1
                decision = autotune(cfg, self.device, build_task(cfg).build_model, pipelined=pipelined)
        return broadcast_object(decision)

    def _time_modes(self, model: torch.nn.Module) -> dict[str, float]:
        """auto precision's probe: one block's forward and backward per mode, timed on rank 0 for every rank."""
        plan = model.parallel_plan(self.cfg.parallel.wrap)
        shape = plan.block_input_shape(self.cfg.train.batch_size)
        timed = time_block_modes(plan.checkpoint_units[0], shape, device=self.device) if self.is_main else None
        return broadcast_object(timed)

    # ------------------------------------------------------------------------------------------ state

    def _choose_run(self, resume: bool | str) -> Path | None:
        """Rank 0 picks the run folder and the checkpoint to continue (runs.choose_run) and tells the others.

        Under torchrun the folder is also kept in the launch's store, where a restarted worker group finds it.
        """
        with all_or_none("choosing the run folder"):
            choice = None
            if self.is_main:
                store = launch_store()
                restarted_in = None
                if restart_count() > 0 and store is not None and store.check([RUN_DIR_KEY]):
                    restarted_in = Path(store.get(RUN_DIR_KEY).decode())
                choice = choose_run(self.run_dir, resume, restarted_in, check=self._check_same_model)
                if store is not None:
                    store.set(RUN_DIR_KEY, str(choice.run_dir))
                choice = (
                    str(choice.run_dir),
                    choice.checkpoint and str(choice.checkpoint),
                    choice.is_new,
                    choice.notes,
                )
        run_dir, checkpoint, self.is_new_run, self.notes = broadcast_object(choice)
        self.run_dir = Path(run_dir)
        return Path(checkpoint) if checkpoint else None

    def _check_same_model(self, path: Path, meta: dict[str, Any]) -> None:
        saved = config_from_dict(meta["config"])
        # init_from only chose the starting weights; the checkpoint's weights replace them either way. The attention
        # kernel computes the same function of the same weights (auto may pick another one on another machine).
        same = {"init_from": "", "attention": "auto"}
        if dataclasses.replace(saved.model, **same) != dataclasses.replace(self.cfg.model, **same):
            raise CheckpointError(
                f"checkpoint {path} was trained with a different model config; resume with the same model.* keys"
            )

    def close(self) -> None:
        """Let go of the model, optimizer and data before the process group is destroyed.

        A DDP wrapper that outlives its process group destroys the group itself when it is freed, joining gloo's
        worker threads while holding the GIL; a worker still releasing a collective's Python tensors waits for the
        GIL: a deadlock at exit (seen after a torchrun restart). An error's traceback keeps this trainer alive past
        the group's end, so the references go here.
        """
        self.model = self.forward = self.optimizer = self.precision = self.head = self.head_optimizer = None
        self.engine = None
        self.task = self.train_loader = self.epoch_batches = self.pipeline = None
        gc.collect()

    def meta(self, is_best: bool = False) -> dict[str, Any]:
        """Everything but the tensors; the data position is in samples so another world size can resume it."""
        return {
            "config": to_dict(self.cfg),
            "engine": self.engine.name,
            "precision": self.engine.state_dict(),
            "step": self.step,
            "epoch": self.epoch,
            "samples_in_epoch": self.batch_in_epoch * self.global_micro_batch,
            "best_metric": self.best_metric,
            "best_metric_name": self.task.best_metric,
            "last_eval": self.last_eval,
            "world_size": self.dist.world_size,
            "strategy": self.cfg.parallel.strategy,
            "is_best": is_best,
            "wall_s": self.wall_s(),  # the run's wall clock continues from here on resume (train.time_limit_s)
            "setup_s": self.setup_s,
        }

    def load(self, path: Path) -> None:
        # Every rank reads and checks before the collective load: one rank's failure stops all of them.
        with all_or_none(f"reading checkpoint {path}"):
            meta = ckpt.read_meta(path)
            self._check_same_model(path, meta)
            samples = meta["samples_in_epoch"]
            if samples % self.global_micro_batch:
                raise CheckpointError(
                    f"checkpoint {path} stopped {samples} samples into an epoch, not a multiple of this run's "
                    f"{self.global_micro_batch} per micro-step; keep train.batch_size x processes unchanged to resume"
                )
            saved_engine = meta.get("engine", "native")
            if saved_engine != self.engine.name:
                raise CheckpointError(
                    f"checkpoint {path} was written by train.engine={saved_engine}; resume it with "
                    f"train.engine={saved_engine} (`vitrain export` turns either into fp32 weights)"
                )
        restored = self.engine.load(path, meta)
        self.step, self.epoch = meta["step"], meta["epoch"]
        self.batch_in_epoch = samples // self.global_micro_batch
        # Checkpoints before the task seam kept the classifier's best top-1 as best_top1.
        if "best_metric" in meta:
            self.best_metric = meta["best_metric"]
        else:  # best_top1 = -1.0 meant "no evaluation yet"
            self.best_metric = meta["best_top1"] if meta.get("best_top1", -1.0) >= 0 else None
        self.last_eval = meta["last_eval"]
        self.started -= meta.get("wall_s", 0.0)
        self.setup_s = meta.get("setup_s")
        saved_ranks, ranks = meta.get("world_size", 1), self.dist.world_size
        if saved_ranks != ranks:
            kept = min(saved_ranks, ranks)
            what = f"ranks 0-{kept - 1} continue their own RNG states"
            if ranks > saved_ranks:
                what += f", ranks {saved_ranks}-{ranks - 1} start from seed + rank"
            else:
                what += f", the states of ranks {ranks}-{saved_ranks - 1} are not used"
            self.notes.append(f"checkpoint from {saved_ranks} processes, {ranks} now: {what}")
        elif not restored:
            self.notes.append(f"checkpoint {path} holds no RNG state for this run's ranks: they start from seed + rank")

    @property
    def global_micro_batch(self) -> int:
        return self.cfg.train.batch_size * self.dist.data_size

    @property
    def parameters(self) -> int:
        """The whole model's parameter count, also where a rank holds only a part (a pipeline stage, ZeRO-3)."""
        return self.engine.parameter_count()

    def save(self, is_best: bool = False) -> Path:
        return self.engine.save(self.run_dir, self.step, self.meta(is_best), self.cfg.train.keep_checkpoints)

    # ------------------------------------------------------------------------------------------ loop

    def fit(self) -> dict[str, Any]:
        with all_or_none(f"writing to the run folder {self.run_dir}"):
            if self.is_main:
                mark_run(self.run_dir, self.is_new_run, self.resume_path)
                (self.run_dir / "config.yaml").write_text(to_yaml(self.cfg))
                if self.tuned is not None:
                    (self.run_dir / "autotune.json").write_text(json.dumps(self.tuned.to_json(), indent=2) + "\n")
            log = RunLog(self.run_dir, enabled=self.is_main, tensorboard=self.cfg.log.tensorboard)
        try:
            return self._fit(log)
        finally:
            log.close()
            # A run that stops mid-epoch (an error) stops the loader's prefetch thread now, not at interpreter exit,
            # where a thread still inside torch aborts the process.
            close = getattr(self.epoch_batches, "close", None)
            if close is not None:
                close()

    def _fit(self, log: RunLog) -> dict[str, Any]:
        cfg, t = self.cfg, self.cfg.train
        if self.resume_path is not None:
            self.load(self.resume_path)
        for note in self.notes:
            log.info(note)
        if self.resume_path is not None:
            log.info(f"resumed from {self.resume_path} at step {self.step} (epoch {self.epoch})")
        self._log_header(log)

        wall_start = time.perf_counter()
        train_seconds, train_images, compile_s = 0.0, 0, None
        data_wait_s = 0.0  # time the steps spent blocked on the loader (same steps as train_seconds)
        marks = sorted(m for m in t.eval_at_s if m > self.wall_s())  # train.eval_at_s still ahead
        stop = False
        while self.epoch < t.epochs and not stop:
            bar = tqdm(
                total=self.steps_per_epoch,
                initial=self.batch_in_epoch // t.accum_steps,
                desc=f"epoch {self.epoch + 1}/{t.epochs}",
                disable=not (cfg.log.progress and self.is_main),
                file=sys.stderr,
                dynamic_ncols=True,
                leave=False,
            )
            micro = 0
            step_start = time.perf_counter()
            window_images, window_start, window_wait_s, window_steps = 0, step_start, 0.0, 0
            # Only whole optimizer steps: leftover micro-batches would leak gradients into the next epoch.
            remaining = self.steps_per_epoch * t.accum_steps - self.batch_in_epoch
            self.epoch_batches = self.train_loader.epoch(self.epoch, self.batch_in_epoch)
            batches = WaitTimer(itertools.islice(self.epoch_batches, remaining))
            for images, labels in batches:
                if micro == 0:
                    if self.setup_s is None:
                        self.setup_s = self.wall_s()
                    position = self.schedule_position()
                    lr = self.schedule(position)
                    self.set_lr(lr)
                    size = self.image_size(position)
                    loss_nonfinite = torch.zeros((), dtype=torch.bool, device=self.device)
                if size != cfg.model.image_size:  # data.min_size: a smaller image early in the run
                    images = resize_batch(images, size)
                loss = self.forward_backward(images, labels)
                loss_nonfinite |= ~torch.isfinite(loss)  # checked at the step, without a sync here
                micro += 1
                self.batch_in_epoch += 1
                if micro < t.accum_steps:
                    continue
                grad_norm, skipped = self.optimizer_step(loss_nonfinite)
                micro = 0
                self.step += 1
                if skipped:
                    self._log_skip(log)

                now = time.perf_counter()
                step_images = images.shape[0] * t.accum_steps * self.dist.data_size
                step_wait_s = batches.take()
                if compile_s is None and t.compile:
                    compile_s = now - step_start
                    log.info(f"first step with torch.compile took {compile_s:.1f} s")
                elif self.step > 1 or self.resume_path is not None:
                    train_seconds += now - step_start
                    train_images += step_images
                    data_wait_s += step_wait_s
                window_images += step_images
                window_wait_s += step_wait_s
                window_steps += 1
                bar.update(1)
                if self.step % cfg.log.every_steps == 0 or self.step == 1:
                    loss_value = self.mean_loss(loss).item()
                    images_per_s = window_images / max(now - window_start, 1e-9)
                    wait_frac = window_wait_s / max(now - window_start, 1e-9)
                    bar.set_postfix(
                        loss=f"{loss_value:.4f}", lr=f"{lr:.2e}", img_s=f"{images_per_s:.0f}", wait=f"{wait_frac:.1%}"
                    )
                    log.record(
                        step=self.step,
                        epoch=self.epoch,
                        loss=loss_value,
                        lr=lr,
                        grad_norm=grad_norm,
                        images_per_s=images_per_s,
                        data_wait_s=window_wait_s / window_steps,  # mean per step over the logged window
                        data_wait_frac=wait_frac,  # share of the window's step time spent waiting for data
                        wall_s=self.wall_s(),
                        **({"image_size": size} if cfg.data.min_size else {}),  # progressive resizing's size
                        **self._scaler_fields(),
                    )
                    window_images, window_start, window_wait_s, window_steps = 0, time.perf_counter(), 0.0, 0
                if marks and self.wall_s() >= marks[0]:  # train.eval_at_s: a point on the time-to-accuracy curve
                    marks = [m for m in marks if m > self.wall_s()]
                    self._evaluate_and_save(log, final=False)
                elif t.checkpoint_every_steps and self.step % t.checkpoint_every_steps == 0:
                    self.save()
                if t.max_steps and self.step >= t.max_steps:
                    stop = True
                    break
                if t.time_limit_s and self.wall_s() + self.last_eval_s >= t.time_limit_s:
                    log.info(
                        f"train.time_limit_s={t.time_limit_s:g}: stopping at step {self.step} after "
                        f"{self.wall_s():.0f} s, leaving {self.last_eval_s:.0f} s for the last evaluation"
                    )
                    stop = True
                    break
                step_start = time.perf_counter()
            bar.close()
            if not stop:
                self.epoch += 1
                self.batch_in_epoch = 0
            final = stop or self.epoch == t.epochs
            if final or self.epoch % t.eval_every_epochs == 0:
                self._evaluate_and_save(log, final)

        wall_s = time.perf_counter() - wall_start
        summary = self._summary(wall_s, train_images / train_seconds if train_seconds else 0.0, compile_s)
        summary["data_wait_s"] = data_wait_s
        summary["data_wait_frac"] = data_wait_s / train_seconds if train_seconds else 0.0
        if self.is_main:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        metric = self.task.best_metric
        log.info(
            f"done: {metric}={summary.get(metric, 0.0):.4f} images/s={summary['images_per_s']:.0f} "
            f"data_wait={summary['data_wait_frac']:.1%} wall={wall_s:.1f}s -> {self.run_dir / 'summary.json'}"
        )
        return summary

    def loss(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The training loss of one micro-batch: the task's, in fp32 under every precision policy."""
        with self.engine.autocast():
            output = self.forward(images)
        return self.task.loss(output, labels)

    def forward_backward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One micro-step: its loss (detached), its gradients added to those of the step's earlier micro-steps."""
        return self.engine.forward_backward(images, labels, self.loss)

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Collective: the global batch's loss, from every rank's micro-step loss."""
        return self.pipeline.mean_loss(loss) if self.pipeline is not None else mean_over_ranks(loss)

    def set_lr(self, lr: float) -> None:
        self.engine.set_lr(lr)

    def optimizer_step(self, loss_nonfinite: torch.Tensor | None = None) -> tuple[float | None, bool]:
        """One optimizer step of the model (and the task's head); returns (gradient norm, skipped)."""
        return self.engine.step(loss_nonfinite)

    def _log_skip(self, log: RunLog) -> None:
        fields, line = self.engine.skip_report()
        if line:
            log.info(f"step {self.step}: {line}")
        log.record(step=self.step, epoch=self.epoch, skipped=True, **fields)

    def _scaler_fields(self) -> dict[str, Any]:
        return self.engine.scaler_fields()

    def schedule_position(self) -> float:
        """The step the lr schedule is read at: the step, or under schedule.horizon=time the share of the training
        time budget spent so far, in steps (whichever is further)."""
        if self.cfg.schedule.horizon != "time":
            return self.step
        budget = self.cfg.train.time_limit_s - self.setup_s - self.last_eval_s
        spent = (self.wall_s() - self.setup_s) / max(budget, 1e-9)
        return max(float(self.step), min(spent, 1.0) * self.total_steps)

    def image_size(self, position: float) -> int:
        """The training image size at schedule position `position` (data.min_size; else model.image_size)."""
        d, m = self.cfg.data, self.cfg.model
        return progressive_size(position / self.total_steps, d.min_size, m.image_size, d.size_ramp, m.patch_size)

    def wall_s(self) -> float:
        """Seconds since this run's setup began (data decoding, autotune and evaluations included)."""
        return time.perf_counter() - self.started

    def _evaluate_and_save(self, log: RunLog, final: bool) -> None:
        begin = time.perf_counter()
        with self.engine.autocast():
            metrics = self.task.evaluate(self.forward, final, self.run_dir)
        ema = getattr(self.engine, "ema", None)
        if ema is not None:  # the average of the weights, evaluated in the run's compute dtype
            with ema.autocast(self.precision.dtype):
                averaged = self.task.evaluate(ema.module, final, self.run_dir / "ema")
            metrics |= {f"ema_{name}": value for name, value in averaged.items()}
        self.last_eval_s = time.perf_counter() - begin
        # When (in the run's wall clock) this evaluation's weights existed: the time-to-accuracy curve.
        self.last_eval = metrics | {"wall_s": begin - self.started, "eval_s": self.last_eval_s}
        value = self.last_eval[self.task.best_metric]
        is_best = is_better(self.task, value, self.best_metric)
        if is_best:
            self.best_metric = value
        log.record(step=self.step, epoch=self.epoch, **self.last_eval)
        line = self.task.eval_line(self.last_eval)
        if ema is not None:
            line += f" | ema: {self.task.eval_line(averaged)}"
        log.info(f"epoch {self.epoch} step {self.step} ({begin - self.started:.0f} s): {line}")
        self.save(is_best)

    def _log_header(self, log: RunLog) -> None:
        cfg = self.cfg
        cost = unwrap(self.model).complexity()
        p = cfg.parallel
        global_batch = cfg.train.batch_size * self.dist.data_size * cfg.train.accum_steps
        impl = resolve_impl(cfg.optim.impl, self.device, cfg.optim.name, cfg.parallel.strategy)
        log.info(
            f"vitrain: {self.parameters / 1e6:.2f}M params, {cost.flops / 1e9:.3f} GFLOPs/image, "
            f"device={self.device}, optimizer={cfg.optim.name}[{impl}], "
            f"parallel={p.strategy} x {self.dist.world_size} (wrap={p.wrap}, offload={p.offload}, "
            f"activation checkpointing={p.activation_checkpointing}), "
            f"global batch={global_batch} ({cfg.train.batch_size} x {self.dist.data_size} replicas x "
            f"{cfg.train.accum_steps} accumulation), {self.steps_per_epoch} steps/epoch x {cfg.train.epochs} epochs, "
            f"{len(self.train_loader.data)} train images / {self.task.describe_data()}, run dir {self.run_dir}"
        )
        if self.head is not None:
            log.info(f"head: {self.head.extra_repr()}")
        if self.pipeline is not None:
            log.info(self.pipeline.describe())
        if self.tuned is not None:
            cached = f" (cached decision: {self.tuned.cached_at})" if self.tuned.from_cache else ""
            log.info(f"autotune: {', '.join(f'{k}={v}' for k, v in self.tuned.values.items())}{cached}")
            if "precision.mode" not in self.tuned.values:  # else the precision line gives the reason
                log.info(self.tuned.reason)
        for line in self.engine.describe():
            log.info(line)

    def _summary(self, wall_s: float, images_per_s: float, compile_s: float | None) -> dict[str, Any]:
        metric = self.task.best_metric
        summary = {
            "name": self.cfg.name,
            "task": self.task.name,
            **self.task.summary_defaults,
            **self.last_eval,
            f"best_{metric}": self.best_metric if self.best_metric is not None else -1.0,
            "images_per_s": images_per_s,
            "wall_s": wall_s,
            "epochs": self.epoch,
            "steps": self.step,
            "params": self.parameters,
            "checkpoint": str(ckpt.latest(self.run_dir)),
            "best_checkpoint": str(ckpt.best(self.run_dir) or ckpt.latest(self.run_dir)),
            "device": str(self.device),
            "strategy": self.cfg.parallel.strategy,
            "world_size": self.dist.world_size,
            "global_batch": self.cfg.train.batch_size * self.dist.data_size * self.cfg.train.accum_steps,
            "engine": self.engine.name,
            "precision": self.engine.precision_label,
            **self._scaler_fields(),
        }
        if compile_s is not None:
            summary["compile_s"] = compile_s
        return summary
