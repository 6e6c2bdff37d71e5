"""The training loop: data in; metrics, checkpoints and a summary out. Reads top to bottom."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import json
import os
import signal
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from vitrain import checkpoint as ckpt
from vitrain.config import Config
from vitrain.data.augment import progressive_size, resize_batch
from vitrain.data.loader import WaitTimer, first_batch
from vitrain.device import resolve_device, reuse_freed_host_memory, trim_heap
from vitrain.engine import cluster, report, runs
from vitrain.engine.autotune import autotune
from vitrain.engine.protocol import build_engine, close_engine
from vitrain.engine.runlog import RunLog, Speed, progress_bar
from vitrain.engine.step import TrainStep
from vitrain.engine.token_drop import TokenDrop
from vitrain.engine.trackers import open_sinks
from vitrain.errors import ConfigError, VitrainError
from vitrain.models import VisionTransformer, not_the_vit_line
from vitrain.models.kernels import unfuse_linear_bias
from vitrain.models.plan import auto_wrap
from vitrain.optim import Schedule, scaled_lr
from vitrain.parallel import broadcast_object, init_distributed, mean_over_ranks
from vitrain.parallel.distributed import all_or_none, max_over_ranks, side_group
from vitrain.parallel.materialize import is_on_meta
from vitrain.parallel.pipeline import Pipeline
from vitrain.tasks import Task, build_task, checked_task, is_better, teacher_of
from vitrain.tasks.distill import read_teachers_once
from vitrain.weights import load_pretrained


class Trainer:
    """Builds everything from one config, then `fit()` trains, evaluates, checkpoints and summarizes.

    `model`: a module (or a factory of one) to train instead of the one `model.name` names; `data`: (train, val)
    datasets (or a function of the config making them) instead of data.source's; `task`: a task object instead of
    the one `task.name` names (vitrain/tasks: data, loss, evaluation).
    """

    def __init__(
        self,
        cfg: Config,
        resume: bool | str = False,
        model: Any = None,
        data: Any = None,
        task: Task | None = None,
        changes: dict[str, tuple] | None = None,
    ):
        self.started = time.perf_counter()  # the run's wall clock (train.time_limit_s, wall_s): setup counts
        runs.check_arguments(cfg, resume)
        self.kept: dict[str, Any] | None = None  # a resume with nothing left to train: the run's summary
        self.used = False  # fit() runs once per Trainer (a second would find its own run folder taken)
        runs.check_run_home(cfg)
        self.model = self.engine = None  # built below (close() after a stop during the set-up)
        # Stop signals are caught from here: a preemption while the run is set up (the autotune race, the engine's
        # build: minutes for a large model) stops it before its first step at the next check below, requeued where
        # asked, rather than ending the process with the signal's status. fit() catches them again.
        # Nothing is written before fit(), so a second signal here interrupts at once (KeyboardInterrupt).
        # train.distill's teacher is read once for autotune's candidates and the run's step (each sets up a copy).
        stop_signals = cluster.StopSignals(cfg.run.stop_signals, starting=True, interrupt_again=True)
        self.holder = object()  # the run folder's lock is held for this Trainer (vitrain/engine/runs.py hold_run)
        with stop_signals as signals, read_teachers_once(), runs.owned_by(self.holder):
            try:
                self._set_up(cfg, resume, model, data, task, changes, signals)
            except cluster.Stopped:
                self.close()  # a handed-in model's linear layers are nn.Linear again
                raise
            except BaseException:
                if getattr(self, "run_dir", None) is not None:  # a run refused while it was set up is let go
                    runs.release_run(self.run_dir, self.holder)
                raise
        # A Trainer dropped without fit() or close() lets go of the run when it is collected, not at the process's end.
        weakref.finalize(self, runs.release_run, self.run_dir, self.holder)
        self.setup_signal = signals.received  # one that came after the set-up's last check: fit() stops for it

    def _set_up(
        self,
        cfg: Config,
        resume: bool | str,
        model: Any,
        data: Any,
        task: Task | None,
        changes: dict[str, tuple] | None,
        signals: cluster.StopSignals,
    ) -> None:
        self.cfg, self.run_dir = cfg, cfg.run_dir
        torch.manual_seed(cfg.train.seed)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        if os.environ.get("TORCHELASTIC_RUN_ID"):  # a worker whose launcher dies stops (and saves) with it
            cluster.die_with_parent(signal.SIGTERM)
        device, p = resolve_device(cfg.train.device), cfg.parallel
        self.dist = init_distributed(device, p.strategy, p.backend, timeout_s=cfg.run.collective_timeout_s)
        self.device, self.is_main = self.dist.device, self.dist.is_main
        signals.group = side_group("control")  # every rank agrees on a stop at the checks below
        if self.device.type == "cpu" and cfg.train.reuse_host_memory:
            reuse_freed_host_memory()  # process-wide, from here on (vitrain/device.py)
        resume = runs.resume_choice(cfg.run_dir, resume)  # auto, a requeued SLURM job, a stopped run
        check = lambda path, meta: runs.check_same_run(path, meta, cfg)  # noqa: E731
        choice = runs.agree_on_run(self.run_dir, resume, self.is_main, check)
        self.run_dir, self.resume_path, self.is_new_run = choice.run_dir, choice.checkpoint, choice.is_new
        self.newer_checkpoints = choice.newer  # moved aside once resume_path has loaded (fit)
        self.changes = changes or {}  # what a resume's command line changed in the run's config (engine/runs.py)
        self.notes = choice.notes + runs.change_lines(self.changes)  # logged once the log is open
        t = cfg.train
        # The task owns data, model, head, loss, evaluation and the best metric (vitrain/tasks).
        self.task = checked_task(task) if task is not None else build_task(cfg, model, data)
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
        # auto values (precision, attention): every rank times this run's own step per candidate (engine/autotune.py).

        def sample() -> Any:
            try:
                return first_batch(self.train_loader)
            except Exception:
                if signals.received is None:
                    raise
                return None  # the loader's workers died of the stop signal: autotune's first check stops every rank

        self._stop_before_start(signals)
        stop = lambda: signals.agreed() is not None  # noqa: E731  (asked after each round of the race)
        kept = self.run_dir / "autotune.json" if self.resume_path is not None else None  # the run's own decision
        self.tuned = autotune(
            cfg, self.task, self.dist, sample, pipelined=self.pipeline is not None, stop=stop, kept=kept
        )
        self._stop_before_start(signals)
        if self.tuned is not None and not self.tuned.from_cache and self.device.type == "cpu":
            # The race's candidates are garbage, some of it in reference cycles (modules and their hooks): collect
            # it, then hand its pages back; the heap kept for reuse (above) would otherwise hold them all run.
            gc.collect()
            trim_heap()
        if self.tuned is not None and "model.attention" in self.tuned.values:
            model_cfg = dataclasses.replace(cfg.model, attention=self.tuned.values["model.attention"])
            cfg = self.cfg = self.task.cfg = dataclasses.replace(cfg, model=model_cfg)
        if cfg.parallel.wrap == "auto":  # the unit autotune timed fastest, or its rule (vitrain/models/plan.py)
            rule = auto_wrap(cfg.parallel.strategy)
            wrap = self.tuned.values.get("parallel.wrap", rule) if self.tuned is not None else rule
            parallel_cfg = dataclasses.replace(cfg.parallel, wrap=wrap)
            cfg = self.cfg = self.task.cfg = dataclasses.replace(cfg, parallel=parallel_cfg)

        # parallel.sharded_init: built on the meta device; the strategy draws this rank's shards of the same weights.
        with torch.device("meta") if cfg.parallel.sharded_init else contextlib.nullcontext():
            model = self.task.build_model()  # the same initial weights on every rank (seed)
        check_anatomy(model, cfg.parallel)
        if cfg.model.init_from:
            load_pretrained(model, Path(cfg.model.init_from))
        if cfg.model.inflate_from:  # an image ViT's weights spread over time (vitrain/models/video.py)
            from vitrain.models.video import inflate_into

            inflate_into(model, Path(cfg.model.inflate_from), cfg.model.inflate)
        if self.pipeline is not None:  # this rank's stages only, before they take device memory
            model = self.pipeline.split(model)
        if not cfg.parallel.sharded_init:
            model = model.to(self.device)
        # Dropout and drop-path draw from seed + rank: each rank masks its own samples differently. Data order,
        # augmentation and the DataLoaders have their own generators, functions of (seed, epoch, batch, rank), so
        # nothing a resumed epoch's loader does moves this stream from the checkpoint's state.
        torch.manual_seed(cfg.train.seed + self.dist.rank)
        # Parameters outside the backbone (the face task's identity head): fp32, this rank's rows, own optimizer.
        self.head = self.task.build_head(self.device)
        # The engine (train.engine) sets up precision, parallelism and the optimizers, and owns backward, step,
        # save and load (vitrain/engine/protocol.py); the step drives it (vitrain/engine/step.py).
        decided = self.tuned.precision(cfg.precision) if self.tuned is not None else None
        try:
            self.engine = build_engine(cfg, model, self.dist, self.head, self.pipeline, precision=decided)
            # Token dropping's draws and the task's teacher (train.distill) belong to the step (engine/step.py).
            token_drop, teacher = TokenDrop.from_config(cfg, self.dist.rank), teacher_of(self.task, self.engine)
            self.train_step = TrainStep(self.engine, self.task.loss, t.accum_steps, token_drop, teacher)
        except BaseException:
            unfuse_linear_bias(model)  # a model handed in leaves a failed set-up as it came (close() after a run)
            close_engine(self.engine)
            raise
        self.model = self.engine.model  # the single-device model: parameter names, complexity
        self.forward = self.engine.forward  # what computes the loss and the evaluation
        self.precision = getattr(self.engine, "precision", None)  # the native engine's policy (tools and tests)
        self.step = self.epoch = 0
        self.schedule_offset = 0  # the lr schedule's step minus self.step, after a resume that changed steps/epoch
        self.epoch_batches: Any = None  # the current epoch's batch iterator
        self.resume_at: Any = None  # the loader Position a resume continues this epoch from (None: its start)
        self.batch_in_epoch = 0  # micro-batches of the current epoch consumed since then
        self.best_metric: float | None = None  # the task's best_metric at the best evaluation so far
        self.last_eval: dict[str, Any] = {}
        self.last_eval_s = 0.0  # how long the last evaluation took: train.time_limit_s leaves room for one more
        self.setup_s: float | None = None  # wall_s when training began (the first step of the run, across resumes)
        self.saved_step: int | None = None  # the step of this process's latest checkpoint
        self.log: RunLog | None = None
        self.signals: cluster.StopSignals | None = None  # run.stop_signals, caught while fit() runs
        self.watchdog: cluster.Watchdog | None = None
        self._stop_before_start(signals)

    def close(self) -> None:
        """Let go of the model, optimizer and data before the process group is destroyed: a DDP wrapper freed after
        its group joins gloo's threads holding the GIL, a deadlock at exit (an error's traceback keeps the trainer).
        A model's linear layers that an engine swapped to the CPU kernel's class are nn.Linear again, and the engine
        lets go of what it set up outside itself (the DeepSpeed engine: the launcher variables it set)."""
        self.used = True
        if getattr(self, "run_dir", None) is not None:
            runs.release_run(self.run_dir, self.holder)
        if self.model is not None:
            unfuse_linear_bias(self.model)
        close_engine(self.engine)
        self.model = self.forward = self.precision = self.head = self.engine = self.train_step = None
        self.task = self.train_loader = self.epoch_batches = self.pipeline = None
        gc.collect()

    def meta(self, is_best: bool = False) -> dict[str, Any]:
        return runs.checkpoint_meta(self, is_best)

    @property
    def parameters(self) -> int:
        """The whole model's parameter count, also where a rank holds only a part (a pipeline stage, ZeRO-3)."""
        return self.engine.parameter_count()

    def save(self, is_best: bool = False) -> Path:
        """Collective: a checkpoint of this step; the time the loop was blocked goes to metrics.jsonl
        (checkpoint_blocked_s: the whole write, or under train.checkpoint_async the copy to host memory)."""
        begin = time.perf_counter()
        with self._unwatched():
            path = self.engine.save(self.run_dir, self.step, self.meta(is_best), self.cfg.train.keep_checkpoints)
        self.saved_step = self.step
        if self.log is not None:
            self.log.record(step=self.step, epoch=self.epoch, checkpoint_blocked_s=time.perf_counter() - begin)
        return path

    def wait_for_save(self) -> None:
        """Collective: the async save still being written is complete (its error raised on every rank)."""
        waiter = getattr(self.engine, "wait_for_save", None)  # a user's engine may save synchronously only
        if waiter is not None:
            with self._unwatched():
                waiter()

    def _unwatched(self) -> contextlib.AbstractContextManager:
        """The step watchdog paused (an evaluation, a save): a no-op outside fit()."""
        return self.watchdog.paused() if self.watchdog is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------------------------------ loop

    def fit(self) -> dict[str, Any]:
        if self.used:
            raise ConfigError("this Trainer already ran fit() (or was closed); make a new Trainer")
        self.used = True
        r = self.cfg.run
        log: RunLog | None = None
        status = "failed"  # how the trackers' runs end
        try:
            # Stop signals are caught from here: a preemption while the checkpoint loads (minutes for a large model)
            # stops the run where it was, requeued where asked, rather than killing it with the signal's status.
            # They are let go before the clean-up below, so a signal after a stop ends the process at once (exit 75).
            with cluster.StopSignals(r.stop_signals, side_group("control"), starting=True) as self.signals:
                self.signals.received = self.signals.received or self.setup_signal
                # The checkpoint is loaded before anything in the run folder changes: a resume it refuses leaves the
                # run as it was (its config.yaml included), and the same command without the refused change
                # continues it.
                if self.resume_path is not None:
                    runs.restore(self, self.resume_path)
                self._stop_before_start(self.signals, self.step)
                self.signals.starting = False
                # A resume with nothing left to train keeps the run's summary and changes none of its files.
                self.kept = None
                if self.resume_path is not None and self._trained_all():
                    self.kept = broadcast_object(self._kept_summary() if self.is_main else None)
                with all_or_none(f"writing to the run folder {self.run_dir}"):
                    if self.is_main and self.kept is None:
                        self.notes += runs.move_aside(self.newer_checkpoints, self.resume_path)
                        with runs.owned_by(self.holder):  # a new run claims its folder here
                            runs.write_run_files(self)
                    wanted = self.is_main and self.kept is None
                    sinks = open_sinks(self.cfg, self.run_dir) if wanted else []  # tensorboard, wandb, mlflow
                    log = self.log = RunLog(self.run_dir, enabled=self.is_main, sinks=sinks, files=self.kept is None)
                stacks = self.run_dir / f"stacks-rank{self.dist.rank}.txt"
                with cluster.Watchdog(r.watchdog_steps, r.watchdog_min_s, stacks, self._hung) as self.watchdog:
                    summary = self._fit(log)
            status = "finished"
            return summary
        except cluster.Stopped:
            status = "stopped"
            raise
        except VitrainError as error:  # the line the user sees is in the run's log too
            if log is not None:
                log.info(f"vitrain: error: {error}", echo=False)  # the CLI prints it
            raise
        finally:
            self.log = self.watchdog = None
            if log is not None:
                log.close(status)
            self._let_pending_save_end()
            runs.release_run(self.run_dir, self.holder)  # trained (or stopped): another process may continue it now
            # A run that stops mid-epoch (an error) stops the loader's prefetch thread now, not at interpreter exit,
            # where a thread still inside torch aborts the process.
            getattr(self.epoch_batches, "close", lambda: None)()

    def _stop_before_start(self, signals: cluster.StopSignals, step: int | None = None) -> None:
        """Collective: a stop signal that came while the run was being set up (the Trainer's set-up, the checkpoint's
        load) stops it before its first step: nothing new to save, the checkpoint resumed from stays the resume
        point, run.json marked stopped (the only change to the folder), SLURM requeue where asked; then `Stopped`
        (the CLI exits 75). `step`: the run's; None before fit() has loaded the checkpoint (the step it holds)."""
        signal_name = signals.agreed()
        if signal_name is None:
            return
        requeued = None
        with all_or_none(f"stopping {self.run_dir} before its first step"):
            if step is None:
                step = ckpt.read_meta(self.resume_path)["step"] if self.resume_path is not None else 0
            if self.is_main and self.resume_path is not None and "stopped" not in runs.read_run_file(self.run_dir):
                runs.mark_stopped(self.run_dir, step, signal_name)  # so that the same command continues it
            if self.is_main and self.cfg.run.requeue:
                requeued = cluster.requeue()
        if requeued:
            cluster.say(f"vitrain: {requeued}")
        stopped = cluster.Stopped(signal_name, step, self.resume_path, requeued)
        signals.stopped = stopped  # from here a stop signal ends the process with EXIT_STOPPED (StopSignals)
        raise stopped

    def _fit(self, log: RunLog) -> dict[str, Any]:
        cfg, t = self.cfg, self.cfg.train
        for note in self.notes:
            log.info(note)
        if self.resume_path is not None:
            log.info(f"resumed from {self.resume_path} at step {self.step} ({self.epoch_label()})")
            if self._trained_all():  # nothing to do, as timm and Lightning do: the run's summary stays as it was
                log.info(self._nothing_left_line())
                if self.kept is not None:
                    return self.kept
        for line in report.header_lines(self):
            log.info(line)
        wall_start = time.perf_counter()
        speed = Speed()
        marks = sorted(m for m in t.eval_at_s if m > self.wall_s())  # train.eval_at_s still ahead
        stop = bool(t.max_steps and self.step >= t.max_steps)  # a run continued at its last step trains no more
        while self.epoch < t.epochs and not stop:
            desc, shown = f"epoch {self.epoch + 1}/{t.epochs}", cfg.log.progress and self.is_main
            # Only whole optimizer steps: leftover micro-batches would leak gradients into the next epoch.
            left = self.train_loader.batches_left(self.resume_at)
            remaining = left - left % t.accum_steps
            bar = progress_bar(self.steps_per_epoch, self.steps_per_epoch - remaining // t.accum_steps, desc, shown)
            self.epoch_batches = self.train_loader.epoch(self.epoch, self.resume_at)
            speed.open_window()  # the last epoch's evaluation is not in this epoch's images/s
            batches = WaitTimer(itertools.islice(self.epoch_batches, remaining))
            steps_left = remaining // t.accum_steps
            for _ in range(steps_left):
                step_start = time.perf_counter()
                if self.setup_s is None:
                    self.setup_s = max_over_ranks(self.wall_s(), self.device)
                position = self.schedule_position()
                lr, size = self.schedule(position), self.image_size(position)
                micro_batches = self._micro_batches(batches, size)
                result = self.train_step(micro_batches, lr, steps_done=self.step, progress=position / self.total_steps)
                self.step += 1
                if result.skipped:
                    fields, line = self.engine.skip_report()
                    if line:
                        log.info(f"step {self.step}: {line}")
                    log.record(step=self.step, epoch=self.epoch, skipped=True, **fields)
                first_compiled = t.compile and speed.compile_s is None
                step_s = time.perf_counter() - step_start
                speed.add(step_s, result.images * self.dist.data_size, batches.take())  # the first step untimed
                steps_left -= 1
                self.watchdog.beat(step_s)
                if first_compiled:
                    speed.compile_s = time.perf_counter() - step_start
                    log.info(f"first step with torch.compile took {speed.compile_s:.1f} s")
                bar.update(1)
                if self.step % cfg.log.every_steps == 0 or self.step == 1:
                    loss = self.mean_loss(result.loss).item()
                    window = speed.window()
                    bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", img_s=f"{window['images_per_s']:.0f}")
                    resized = {"image_size": size} if cfg.data.min_size else {}  # progressive resizing's size
                    log.record(step=self.step, epoch=self.epoch, loss=loss, lr=lr, grad_norm=result.grad_norm,
                               **window, wall_s=self.wall_s(), **resized, **self.engine.scaler_fields())  # fmt: skip
                # A stop signal on any rank stops every rank after this same step (one small collective).
                stop_signal = self.signals.agreed()
                if stop_signal is not None:
                    self._stop(log, stop_signal)
                # The clock decides evaluations and the stop: every rank reads the same (the slowest rank's).
                now = max_over_ranks(self.wall_s(), self.device) if marks or t.time_limit_s else 0.0
                if marks and now >= marks[0]:  # train.eval_at_s: a point on the time-to-accuracy curve
                    marks = [m for m in marks if m > now]
                    self._evaluate_and_save(log, final=False)
                elif t.checkpoint_every_steps and self.step % t.checkpoint_every_steps == 0:
                    self.save()
                stop = bool(t.max_steps and self.step >= t.max_steps) or self._out_of_time(log, now)
                if stop:
                    break
            bar.close()
            if steps_left == 0:  # the epoch's last step ran (a train.max_steps stop there included)
                self.epoch += 1
                self.batch_in_epoch, self.resume_at = 0, None
            final = stop or self.epoch == t.epochs
            if final or self.epoch % t.eval_every_epochs == 0:
                self._evaluate_and_save(log, final)
                stop_signal = self.signals.agreed()  # a signal during the evaluation: its checkpoint is the stop's
                if stop_signal is not None and not final:
                    self._stop(log, stop_signal)

        self.wait_for_save()  # train.checkpoint_async: the last checkpoint is complete before the summary
        wall_s = time.perf_counter() - wall_start
        summary = report.summary(self, wall_s, speed.images_per_s(), speed.compile_s) | speed.data_wait()
        for line in report.skipped_samples(self):  # streams and RecordIO find bad samples as they read them
            log.info(line)
        if self.is_main:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        log.summary(summary)
        metric = self.task.best_metric
        log.info(
            f"done: {metric}={summary.get(metric, 0.0):.4f} {cfg.model.sample_unit}s/s={summary['images_per_s']:.0f} "
            f"data_wait={summary['data_wait_frac']:.1%} wall={wall_s:.1f}s -> {self.run_dir / 'summary.json'}"
        )
        return summary

    def _trained_all(self) -> bool:
        """Whether the run already trained every epoch (or step, train.max_steps) its config asks for."""
        t = self.cfg.train
        return self.epoch >= t.epochs or bool(t.max_steps and self.step >= t.max_steps)

    def _nothing_left_line(self) -> str:
        t = self.cfg.train
        if t.max_steps and self.step >= t.max_steps:
            done, more = f"reached train.max_steps={t.max_steps}", f"train.max_steps=<more than {t.max_steps}>"
        else:
            done, more = f"finished its {t.epochs} epochs", f"train.epochs=<more than {t.epochs}>"
        return (
            f"{self.run_dir} already {done} (step {self.step}): nothing left to train; to train longer, resume with "
            + more
        )

    def _kept_summary(self) -> dict[str, Any] | None:
        """A finished run's summary.json (None when missing or unreadable: the summary is written again)."""
        try:
            summary = json.loads((self.run_dir / "summary.json").read_text())
        except (OSError, ValueError):
            return None
        return summary if isinstance(summary, dict) else None

    def _micro_batches(self, batches: Iterator, size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The step's train.accum_steps micro-batches, at the progressive-resizing size, counted as consumed."""
        for images, labels in itertools.islice(batches, self.cfg.train.accum_steps):
            if size != self.cfg.model.image_size:  # data.min_size: a smaller image early in the run
                images = resize_batch(images, size)
            self.batch_in_epoch += 1
            yield images, labels

    def _stop(self, log: RunLog, signal_name: str) -> None:
        """Every rank, after the same step: a checkpoint of it (with the data position), run.json marked stopped,
        SLURM requeue where asked; then `Stopped` (the CLI exits 75). No evaluation: the scheduler's notice is
        short."""
        self.signals.stopping = True
        log.info(f"{signal_name}: stopping after step {self.step} ({self.epoch_label()}): writing a checkpoint")
        with self.watchdog.paused():
            path = self.save() if self.saved_step != self.step else None
            self.wait_for_save()
            path = path or ckpt.latest(self.run_dir, warn=False)
            requeued = None
            with all_or_none(f"marking {self.run_dir} stopped"):  # every rank exits once the requeue is asked
                if self.is_main:
                    runs.mark_stopped(self.run_dir, self.step, signal_name)
                    requeued = cluster.requeue() if self.cfg.run.requeue else None
        if requeued:
            log.info(requeued)
        stopped = cluster.Stopped(signal_name, self.step, path, requeued)
        log.info(f"{stopped}; exit {cluster.EXIT_STOPPED}", echo=False)  # the CLI prints it
        self.signals.stopped = stopped  # from here a stop signal ends the process with EXIT_STOPPED (StopSignals)
        raise stopped

    def _let_pending_save_end(self) -> None:
        """After an error: an async save still being written ends (or fails) before the process group goes; every
        rank's writer is running already, so no collective is needed here."""
        pending = getattr(self.engine, "pending", None)
        if pending is not None:
            with contextlib.suppress(Exception):
                pending.done.result(timeout=self.cfg.run.collective_timeout_s)

    def _hung(self, line: str) -> None:
        """The watchdog's last words (from its thread): stderr on every rank, log.txt on rank 0."""
        cluster.say(f"vitrain: error: rank {self.dist.rank}: {line}")
        if self.is_main:
            with contextlib.suppress(OSError), open(self.run_dir / "log.txt", "a") as text:
                text.write(f"vitrain: error: {line}\n")

    def _out_of_time(self, log: RunLog, now: float) -> bool:
        limit = self.cfg.train.time_limit_s
        if not limit or now + self.last_eval_s < limit:
            return False
        log.info(
            f"train.time_limit_s={limit:g}: stopping at step {self.step} after {now:.0f} s, leaving "
            f"{self.last_eval_s:.0f} s for the last evaluation"
        )
        return True

    def mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Collective: the global batch's loss, from every rank's micro-step loss."""
        return self.pipeline.mean_loss(loss) if self.pipeline is not None else mean_over_ranks(loss)

    def schedule_position(self) -> float:
        """The step the lr schedule is read at: the step, or under schedule.horizon=time the share of the training
        time budget spent so far, in steps (whichever is further)."""
        at = self.step + self.schedule_offset
        if self.cfg.schedule.horizon != "time":
            return at
        budget = self.cfg.train.time_limit_s - self.setup_s - self.last_eval_s
        now = max_over_ranks(self.wall_s(), self.device)  # one lr on every rank: the slowest rank's clock
        spent = (now - self.setup_s) / max(budget, 1e-9)
        return max(float(at), min(spent, 1.0) * self.total_steps)

    def image_size(self, position: float) -> int:
        """The training image size at schedule position `position` (data.min_size; else model.image_size)."""
        d, m = self.cfg.data, self.cfg.model
        return progressive_size(position / self.total_steps, d.min_size, m.image_size, d.size_ramp, m.patch_size)

    def epoch_label(self) -> str:
        """'epoch E/T' for the log's lines, E 1-based as the progress bar's: the epoch under way mid-epoch, else the
        last one finished (the records' `epoch` field counts finished epochs)."""
        at = self.resume_at  # a resume mid-epoch has consumed part of the epoch before this process's first batch
        under_way = self.batch_in_epoch > 0 or (
            at is not None and (at.samples > 0 or any(seg.get("batches", 0) for seg in at.segments))
        )
        return f"epoch {self.epoch + under_way}/{self.cfg.train.epochs}"

    def wall_s(self) -> float:
        """Seconds since this run's setup began (data decoding, autotune and evaluations included)."""
        return time.perf_counter() - self.started

    def _evaluate_and_save(self, log: RunLog, final: bool) -> None:
        begin = time.perf_counter()
        with self._unwatched():
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
        log.info(f"{self.epoch_label()} step {self.step} ({begin - self.started:.0f} s): {line}")
        self.save(is_best)


def check_anatomy(model: Any, p: Any) -> None:
    """Pipeline stages and parallel.sharded_init cut or draw vitrain's ViT by its anatomy: a model handed to the
    library that is not it is refused in one line (model.name's are refused by the config), and so is sharded_init
    for a module handed in whole (built already: nothing is left to draw shard by shard)."""
    if not (p.pipeline_stages > 1 or p.sharded_init):
        return
    if not isinstance(model, VisionTransformer):
        raise ConfigError(not_the_vit_line(p, f"the model handed in ({type(model).__name__})"))
    if p.sharded_init and not is_on_meta(model):
        raise ConfigError(
            "parallel.sharded_init builds the model on the meta device and draws only this rank's shards, but the "
            "model was handed in built: hand in a function of the config that builds it (model=lambda cfg: ...), or "
            "set parallel.sharded_init=false"
        )
