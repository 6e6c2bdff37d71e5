"""Runs the vitrain CLI with one injected fault, for the fault tests: python tests/fault_runner.py FAULT ARGS...

FAULT is one of (RANK: the process's rank; counts start at 1 and restart with each process):
  none                   no fault
  enospc:RANK:SAVE       on RANK, the SAVE-th checkpoint save fails with ENOSPC (a full disk) inside its write
  nan_weight:RANK:SAVE   on RANK, just before the SAVE-th save, one weight of its shard becomes NaN
  kill_op:SAVE:OP        SIGKILL at the OP-th durable file operation (fsync, rename, replace, rmtree) counted from
                         the start of the SAVE-th save: inside a checkpoint write
  kill_after:STEP:MS     SIGKILL MS milliseconds after optimizer step STEP of this process: at a random moment
  kill_step:RANK:STEP    on RANK, SIGKILL right after its STEP-th optimizer step, on torchrun's first try only
  term:WHO:STEP:MS       on WHO (a rank, or all), SIGTERM MS milliseconds after optimizer step STEP, to the process's
                         group when it leads one (as torchrun and SLURM signal a worker), else to the process
  term_twice:WHO:STEP    as term (MS=0), and a second SIGTERM as the stop checkpoint's save begins
  term_kill:WHO:STEP:OP  as term (MS=0), then SIGKILL at the OP-th durable file operation of the stop save
  term_load:WHO          on WHO (a rank, or all), SIGTERM as a resume's checkpoint load begins
  term_setup:WHO         on WHO (a rank, or all), SIGTERM as the trainer's set-up builds the engine (before fit)
  stall:RANK:STEP:S      on RANK, optimizer step STEP sleeps S seconds (a stuck rank)
When a fault fires, its time is written to $VITRAIN_FAULT_LOG (if set), so a test can time what follows.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import sys
import threading
import time

_REAL_FSYNC = os.fsync  # the faults below replace os.fsync; recording a fault must not trip them


def main() -> int:
    fault, argv = sys.argv[1], sys.argv[2:]
    kind, *values = fault.split(":")
    numbers = (
        numbers_of(values)
        if kind not in ("term", "term_twice", "term_kill", "term_load", "term_setup", "stall")
        else []
    )
    rank = int(os.environ.get("RANK", "0"))
    if kind == "enospc" and rank == numbers[0]:
        _fail_save_with_enospc(numbers[1])
    elif kind == "nan_weight" and rank == numbers[0]:
        _nan_before_save(numbers[1])
    elif kind == "kill_op":
        _kill_inside_save(*numbers)
    elif kind == "kill_after":
        _kill_after_step(*numbers)
    elif kind == "kill_step" and rank == numbers[0] and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        _kill_after_step(numbers[1], 0)
    elif kind in ("term", "term_twice", "term_kill") and values[0] in ("all", str(rank)):
        _term_after_step(kind, *numbers_of(values[1:]))
    elif kind == "term_load" and values[0] in ("all", str(rank)):
        _term_on_load()
    elif kind == "term_setup" and values[0] in ("all", str(rank)):
        _term_on_engine_build()
    elif kind == "stall" and rank == int(values[0]):
        _stall_in_step(int(values[1]), float(values[2]))
    elif kind not in (
        "none",
        "enospc",
        "nan_weight",
        "kill_step",
        "term",
        "term_twice",
        "term_kill",
        "term_load",
        "term_setup",
        "stall",
    ):
        raise SystemExit(f"unknown fault {fault}")
    from vitrain.cli import main as cli_main

    return cli_main(argv)


def _fired(what: str) -> None:
    log = os.environ.get("VITRAIN_FAULT_LOG")
    if log:
        with open(f"{log}.{os.environ.get('RANK', '0')}", "w") as handle:
            handle.write(f"{time.time()} {what}\n")
            handle.flush()
            _REAL_FSYNC(handle.fileno())


def _sigkill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _count_saves(on_save) -> None:
    """Call on_save(n) as the n-th checkpoint save of this process starts."""
    from vitrain import checkpoint

    original = checkpoint.save
    count = 0

    def save(*args, **kwargs):
        nonlocal count
        count += 1
        on_save(count)
        return original(*args, **kwargs)

    checkpoint.save = save


def _fail_save_with_enospc(target: int) -> None:
    real_fsync = os.fsync
    active = False

    def on_save(n: int) -> None:
        nonlocal active
        active = n == target

    def fsync(fd: int) -> None:
        if active:
            _fired("enospc")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    _count_saves(on_save)
    os.fsync = fsync


def _nan_before_save(target: int) -> None:
    import torch

    from vitrain.engine.trainer import Trainer

    original = Trainer.save
    count = 0

    def save(self, *args, **kwargs):
        nonlocal count
        count += 1
        if count == target:
            shards = [w.to_local() if hasattr(w, "to_local") else w for w in self.model.parameters()]
            local = next(shard for shard in shards if shard.numel())  # a rank's shard of a small tensor may be empty
            with torch.no_grad():
                local.view(-1)[0] = float("nan")
            _fired("nan_weight")
        return original(self, *args, **kwargs)

    Trainer.save = save


def _kill_inside_save(target_save: int, target_op: int, after=lambda: True) -> None:
    ops = 0
    counting = False

    def on_save(n: int) -> None:
        nonlocal counting
        counting = counting or (n >= target_save and after())

    def durable(function):
        def wrapper(*args, **kwargs):
            nonlocal ops
            if counting:
                ops += 1
                if ops == target_op:
                    _sigkill()
            return function(*args, **kwargs)

        return wrapper

    _count_saves(on_save)
    os.fsync, os.rename, os.replace = durable(os.fsync), durable(os.rename), durable(os.replace)
    shutil.rmtree = durable(shutil.rmtree)


class _Steps:
    """Wraps PrecisionPolicy.step: `before(n)` and `after(n)` run around this process's n-th optimizer step (from 1,
    autotune's steps included); `done` is how many have finished."""

    def __init__(self, before=lambda n: None, after=lambda n: None) -> None:
        from vitrain.precision import PrecisionPolicy

        original, self.done = PrecisionPolicy.step, 0

        def step(policy, *args, **kwargs):
            before(self.done + 1)
            result = original(policy, *args, **kwargs)
            self.done += 1
            after(self.done)
            return result

        PrecisionPolicy.step = step


def _later(delay_ms: int, action) -> None:
    """`action()` now, or `delay_ms` milliseconds from now on a timer thread."""
    if delay_ms:
        threading.Timer(delay_ms / 1000, action).start()
    else:
        action()


def _kill_after_step(target_step: int, delay_ms: int) -> None:
    def after(n: int) -> None:
        if n == target_step:
            _fired("kill")
            _later(delay_ms, _sigkill)

    _Steps(after=after)


def numbers_of(values: list[str]) -> list[int]:
    return [int(v) for v in values]


def _sigterm() -> None:
    """SIGTERM as a launcher sends it: to the process group the process leads (its DataLoader workers included)."""
    if os.getpgid(0) == os.getpid():
        os.killpg(os.getpid(), signal.SIGTERM)
    else:
        os.kill(os.getpid(), signal.SIGTERM)


def _term_after_step(kind: str, target_step: int, extra: int = 0) -> None:
    """SIGTERM after step `target_step` (term: `extra` ms later); term_twice: again as the stop save begins;
    term_kill: SIGKILL at the `extra`-th durable operation of the stop save. The fault log gets the steps done just
    before and just after the signal."""

    def fire() -> None:
        # Steps done just before and just after the signal is sent: on the timer thread (term's MS) the main thread
        # may finish a step, and pass the step boundary where the ranks agree, between the two.
        before = steps.done
        _sigterm()
        _fired(f"term {before} {steps.done}")

    def after(n: int) -> None:
        if n == target_step:
            _later(extra if kind == "term" else 0, fire)

    steps = _Steps(after=after)
    if kind == "term_twice":
        _count_saves(lambda n: _sigterm() if steps.done >= target_step else None)
    elif kind == "term_kill":
        _kill_inside_save(1, extra, after=lambda: steps.done >= target_step)


def _term_on_load() -> None:
    """SIGTERM as the trainer starts loading the checkpoint it resumes from (before the engine reads its files)."""
    from vitrain.engine import runs

    _term_before(runs, "restore", "term_load")


def _term_on_engine_build() -> None:
    """SIGTERM as the trainer's set-up starts building the engine (after the data and the autotune race)."""
    from vitrain.engine import trainer

    _term_before(trainer, "build_engine", "term_setup")


def _term_before(module, name: str, fault: str) -> None:
    """`module.name` sends SIGTERM (and records `fault`) before it runs."""
    original = getattr(module, name)

    def signalled(*args, **kwargs):
        _sigterm()
        _fired(fault)
        return original(*args, **kwargs)

    setattr(module, name, signalled)


def _stall_in_step(target_step: int, seconds: float) -> None:
    def before(n: int) -> None:
        if n == target_step:
            _fired("stall")
            time.sleep(seconds)

    _Steps(before=before)


if __name__ == "__main__":
    sys.exit(main())
