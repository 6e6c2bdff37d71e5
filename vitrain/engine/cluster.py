"""Life on a shared cluster: a graceful stop agreed by all ranks, SLURM requeue, and the step watchdog."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

from vitrain.config import Config
from vitrain.errors import ConfigError

EXIT_STOPPED = 75  # stopped by a signal with its checkpoint written: run the same command again (EX_TEMPFAIL)
EXIT_HUNG = 70  # the watchdog: no step completed in time (EX_SOFTWARE); a restart resumes the last checkpoint
UNCATCHABLE = ("SIGKILL", "SIGSTOP")


class Stopped(Exception):
    """A run stopped by a signal after writing its checkpoint; the CLI exits EXIT_STOPPED. Not an error: running
    the same command again continues the run at the next step."""

    def __init__(self, signal_name: str, step: int, checkpoint: Path | None, requeue_line: str | None = None):
        self.signal_name, self.step, self.checkpoint, self.requeue_line = signal_name, step, checkpoint, requeue_line
        self.said = False  # its line is on stderr (the CLI prints it; StopSignals does where the process ends first)
        if step == 0 and checkpoint is None:  # a new run stopped before its first step: nothing of it was written
            super().__init__(f"stopped by {signal_name} before the first step (nothing saved); run the same command "
                             "again to start the run")  # fmt: skip
            return
        where = f"checkpoint {checkpoint}" if checkpoint else "nothing new to save"
        super().__init__(f"stopped by {signal_name} at step {step} ({where}); run the same command again to continue")


def check(cfg: Config) -> None:
    """The run section: one line naming the value and the fix."""
    r = cfg.run
    for name in r.stop_signals:
        if name in UNCATCHABLE or not isinstance(getattr(signal, name, None), signal.Signals):
            raise ConfigError(
                f"run.stop_signals: {name} is not a signal a process can catch; use names such as SIGTERM, SIGINT, "
                "SIGUSR1, SIGUSR2 ([] turns graceful stops off)"
            )
    if r.collective_timeout_s <= 0:
        raise ConfigError(f"run.collective_timeout_s={r.collective_timeout_s:g} must be positive seconds, e.g. 1800")
    if r.watchdog_steps < 0 or r.watchdog_min_s < 0:
        raise ConfigError(
            f"run.watchdog_steps={r.watchdog_steps:g} and run.watchdog_min_s={r.watchdog_min_s:g} must be >= 0 "
            "(run.watchdog_steps=0 turns the watchdog off)"
        )


# ---------------------------------------------------------------------------------------------- graceful stop


class StopSignals:
    """While entered, the configured signals only set a flag; `agreed()` (collective, at each step boundary) tells
    every rank whether any rank has received one, so all stop after the same step.

    The handler does no work itself: the stop path (a checkpoint, then exit) runs in the training loop, not in a
    signal handler. A second signal while stopping is said on stderr and changes nothing; a SIGKILL during the save
    leaves the previous checkpoint as the resume point (saves are atomic).

    Once the stop path has raised `stopped`, the process is on its way out, and a launcher signals the ranks still
    tearing down as soon as the first one exits (torchrun sends SIGTERM). The signal's default action would end them
    there, without their stop line and with the signal's status instead of EXIT_STOPPED. So leaving the context
    after a stop does not restore the previous handlers where a launcher runs the process (several ranks, torchrun,
    SLURM): a stop signal from then on says the stop's line (unless it was said) and ends the process with
    EXIT_STOPPED at once, its checkpoint being written. A process of its own (a notebook) gets its handlers back.

    `interrupt_again` (the trainer's set-up, where nothing is written yet): a SIGINT after a received signal raises
    KeyboardInterrupt at once, so Ctrl-C twice interrupts a slow set-up. Other signals twice do not: a launcher and
    SLURM may both deliver one preemption.
    """

    def __init__(
        self, names: tuple[str, ...], group: Any = None, starting: bool = False, interrupt_again: bool = False
    ):
        self.signals = [signal.Signals[name] for name in names]
        self.group = group  # a gloo group of all ranks (None: one process)
        self.starting = starting  # before the first step (a resume's checkpoint load): there is nothing to save
        self.interrupt_again = interrupt_again
        self.received: signal.Signals | None = None
        self.stopping = False
        self.stopped: Stopped | None = None  # what the stop path raised: the process is ending (see above)
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # Python sets handlers only there
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        launched = self.group is not None or "TORCHELASTIC_RUN_ID" in os.environ or slurm_job() is not None
        for sig, previous in self._previous.items():
            ending = self.stopped is not None and sig in self.signals and launched
            signal.signal(sig, self._exit_stopped if ending else previous)
        self._previous.clear()

    def _exit_stopped(self, signum: int, frame: FrameType | None) -> None:
        """A stop signal after the stop (installed by __exit__ only once `stopped` is set): the stop's line where it
        has not been said, then EXIT_STOPPED now."""
        if not self.stopped.said:
            say(f"vitrain: {self.stopped}")
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # inside a write's retry a flush is refused: what is written stays
                stream.flush()
        os._exit(EXIT_STOPPED)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            self.received = signal.Signals(signum)
            # torchrun and SLURM signal the whole process group: DataLoader workers die of it, and torch's SIGCHLD
            # handler would then raise in the middle of the stop checkpoint. The loader is not read again.
            if hasattr(signal, "SIGCHLD") and signal.SIGCHLD not in self._previous:
                self._previous[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            now = (
                "before the first step (nothing new to save)"
                if self.starting
                else "after this step, writing a checkpoint"
            )
            say(f"vitrain: {name}: stopping {now}, then exiting {EXIT_STOPPED}")
        elif self.interrupt_again and signum == signal.SIGINT:
            say(f"vitrain: {name} again: interrupting the set-up (nothing of the run was written)")
            raise KeyboardInterrupt
        else:
            what = (
                "stopping before the first step" if self.starting
                else "writing the stop checkpoint" if self.stopping else "stopping after this step"
            )  # fmt: skip
            say(f"vitrain: {name} again: already {what}; if killed now, the previous checkpoint stays the resume point")

    def agreed(self) -> str | None:
        """Collective: the name of a stop signal some rank received (the highest number when several), else None."""
        code = int(self.received or 0)
        if self.group is not None:
            import torch
            import torch.distributed as dist

            flag = torch.tensor([code], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            code = int(flag.item())
        if code and self.received is None:  # another rank's signal: this one stops too, and says why
            self.received = signal.Signals(code)
        return signal.Signals(code).name if code else None


def say(line: str) -> None:
    """A line on stderr from a signal handler or a watchdog thread (os.write: no lock print might hold)."""
    with contextlib.suppress(OSError):
        os.write(sys.stderr.fileno(), (line + "\n").encode())


def die_with_parent(sig: signal.Signals) -> None:
    """Linux: this process gets `sig` when the launcher that started it exits (a killed launcher's workers do not
    train on alone: torchrun starts them in sessions of their own); elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG


# ---------------------------------------------------------------------------------------------- SLURM


def slurm_job(env: Mapping[str, str] = os.environ) -> str | None:
    """The SLURM job this process runs in (an array task as JOB_TASK), or None outside SLURM."""
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID") or None


def requeued(env: Mapping[str, str] = os.environ) -> bool:
    """Whether this SLURM job is a requeued run of an earlier one (it then continues its run by default)."""
    return slurm_job(env) is not None and int(env.get("SLURM_RESTART_COUNT", "0") or 0) > 0


def requeue(env: Mapping[str, str] = os.environ) -> str:
    """Ask SLURM to requeue this job (`scontrol requeue JOB`); the line to log. Never raises: the checkpoint is
    already written, and a failed requeue only means the user restarts the job."""
    job = slurm_job(env)
    if job is None:
        return "run.requeue=true but this is not a SLURM job (no SLURM_JOB_ID): not requeued"
    if shutil.which("scontrol") is None:
        return f"run.requeue=true: scontrol is not on the PATH: job {job} not requeued"
    try:
        shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=60)
        if "JobState=CANCELLED" in shown.stdout:  # scancel's SIGTERM: the user ended it, it is not to come back
            return f"SLURM job {job} was cancelled: not requeued"
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"scontrol requeue {job} failed: {error}"
    if done.returncode != 0:
        reason = " ".join((done.stderr or done.stdout).split()) or f"exit {done.returncode}"
        return f"scontrol requeue {job} failed: {reason}"
    return f"requeued SLURM job {job} (scontrol requeue): it continues this run when it starts again"


# ---------------------------------------------------------------------------------------------- watchdog


class Watchdog:
    """A thread that ends a stuck process: when no step completes within max(min_s, factor x the median step time),
    it writes every thread's stack to stderr and to `stacks_file`, says why in `log`, and exits EXIT_HUNG.

    Armed after the first step (whose time includes compilation), paused around evaluations and saves (the
    collective timeout covers those). Each rank runs its own: a rank stuck in a step and the ranks waiting for it
    in a collective all end, so torchrun or the scheduler restarts the job from its last checkpoint.
    """

    def __init__(self, factor: float, min_s: float, stacks_file: Path, log: Callable[[str], None] = say):
        self.factor, self.min_s, self.stacks_file, self.log = factor, min_s, stacks_file, log
        self.durations: deque[float] = deque(maxlen=51)
        self.last = time.monotonic()
        self.pauses = 0
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.factor > 0

    def __enter__(self) -> Watchdog:
        if self.enabled:
            self._thread = threading.Thread(target=self._watch, name="vitrain-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def beat(self, step_s: float) -> None:
        """A step completed after `step_s` seconds."""
        self.durations.append(step_s)
        self.last = time.monotonic()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self.pauses += 1
        try:
            yield
        finally:
            self.last = time.monotonic()  # before the count drops: the thread never sees an old `last` unpaused
            self.pauses -= 1

    def deadline(self) -> float | None:
        """Seconds without a step after which the process is taken for hung (None: not armed yet)."""
        if not self.durations:
            return None
        return max(self.min_s, self.factor * statistics.median(self.durations))

    def _watch(self) -> None:
        while not self._done.wait(0.2):
            if self.pauses:
                continue
            deadline = self.deadline()
            waited = time.monotonic() - self.last
            if deadline is None or self.pauses or waited < deadline:
                continue
            median = statistics.median(self.durations)
            self.log(
                f"watchdog: no step completed in {waited:.1f} s (deadline max(run.watchdog_min_s={self.min_s:g}, "
                f"run.watchdog_steps={self.factor:g} x median step {median:.3f} s)); every thread's stack is in "
                f"{self.stacks_file}; exiting {EXIT_HUNG} (a restart resumes from the last checkpoint)"
            )
            _dump_stacks(self.stacks_file)
            os._exit(EXIT_HUNG)


def _dump_stacks(path: Path) -> None:
    """Every thread's Python stack, to stderr and to `path`."""
    with contextlib.suppress(OSError):
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    with contextlib.suppress(OSError), open(path, "w") as handle:
        faulthandler.dump_traceback(file=handle, all_threads=True)
        handle.flush()
        os.fsync(handle.fileno())
