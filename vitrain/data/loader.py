"""The fast loader: seeded per-epoch order, batched uint8 reads, device-side augmentation, prefetch, resumable.

Works over any data with `read(index) -> (uint8 images, labels)`: an in-memory ImageSet or a memory-mapped
PreparedSet. A background thread reads, pins, copies and augments the next batches while the step runs.
"""

from __future__ import annotations

import ast
import contextvars
import functools
import multiprocessing
import os
import queue
import select
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from vitrain.data.augment import BatchAugment
from vitrain.errors import ConfigError, VitrainError


class BatchSource(Protocol):
    classes: list[str]

    def __len__(self) -> int: ...

    def read(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


def read_batch(data: BatchSource, rows: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`data.read(rows)`; a source whose reads are random (`draws_on_read`: a video set's training clips start at a
    random frame) draws from the batch's generator, before augmentation does, so a resume replays its draws too."""
    if getattr(data, "draws_on_read", False):
        return data.read(rows, generator)
    return data.read(rows)


@dataclass
class Position:
    """Where a loader stands in an epoch: what a checkpoint keeps so that a resume continues with the samples an
    uninterrupted run would have seen, and, on another world size, with none of the epoch's seen ones again.

    Random-access sources: `samples` of the epoch's sequence (`epoch_sequence`) consumed (always a prefix, on any
    world size).
    Streams: `segments`, the layouts that ran in this epoch (world size, workers, batch size) with the batches each
    consumed; what they consumed is recomputed from the seed, nothing per rank needs saving (vitrain/data/stream.py).
    """

    epoch: int = 0
    samples: int = 0
    segments: list[dict[str, int]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(saved: dict[str, Any] | None) -> Position | None:
        return None if saved is None else Position(int(saved["epoch"]), int(saved.get("samples", 0)),
                                                   [dict(s) for s in saved.get("segments", [])])  # fmt: skip


TRACE_ENV = "VITRAIN_SAMPLE_TRACE"  # a file: each consumed batch's sample keys appended as one line (tests, audits)
# Set while first_batch takes a batch that no step trains on (autotune's race): the trace lists training's batches.
_UNTRACED: contextvars.ContextVar[bool] = contextvars.ContextVar("vitrain_untraced", default=False)


def trace(batches: Iterator[tuple[Any, Any, list]], what: str) -> Iterator[tuple[Any, Any]]:
    """(images, labels) of (images, labels, keys) batches; with VITRAIN_SAMPLE_TRACE set, each batch's keys are
    appended to that file, after `what` (train or val), as the consumer takes it (what a training step consumed,
    not what prefetch read ahead)."""
    path = None if _UNTRACED.get() else os.environ.get(TRACE_ENV)
    try:
        for images, labels, keys in batches:
            if path:
                with open(path, "a") as f:
                    f.write(" ".join([what, *(str(k) for k in keys)]) + "\n")
            yield images, labels
    finally:  # a consumer that stops early stops the prefetch thread now, not whenever `batches` is collected
        getattr(batches, "close", lambda: None)()


# The label of a sample that pads a rank's share (cross_entropy's default ignore_index: it adds no loss).
PAD_LABEL = -100


def epoch_sequence(n: int, epoch: int, seed: int, shuffle: bool, repeats: int = 1) -> torch.Tensor:
    """The epoch's n sample indices before ranks share them: a permutation fixed by (seed, epoch), or 0..n-1
    without shuffle (where `repeats` does nothing).

    repeats > 1 (data.repeated_aug, DeiT's RASampler): each index of the permutation `repeats` times in a row, cut
    back to n, so that the epoch keeps its length; dealt round robin, the copies of an image go to consecutive ranks
    (different ones when world_size >= repeats), and each copy gets its own augmentation.
    """
    if not shuffle:
        return torch.arange(n)
    index = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
    return index.repeat_interleave(repeats)[:n] if repeats > 1 else index


def epoch_order(
    n: int,
    epoch: int,
    seed: int,
    shuffle: bool,
    rank: int = 0,
    world_size: int = 1,
    drop_last: bool = True,
    repeats: int = 1,
) -> torch.Tensor:
    """This rank's sample indices for `epoch`: a disjoint share (every world_size-th) of `epoch_sequence`.

    Without drop_last the order is padded at its end, by repeating its first samples, to a multiple of
    world_size, so that every rank runs the same number of batches (FSDP's forward is collective); the padding
    sits after the real samples of each share and its labels become PAD_LABEL (`mask_padding`).
    """
    index = epoch_sequence(n, epoch, seed, shuffle, repeats)
    if drop_last:
        index = index[: n - n % world_size]
    elif n:
        index = torch.cat([index, index.repeat(world_size)[: -n % world_size]])
    return index[rank::world_size]


def mask_padding(labels: torch.Tensor, first: int, n: int, rank: int, world_size: int) -> torch.Tensor:
    """Give PAD_LABEL to the padding in a batch that starts at position `first` of this rank's share of n samples."""
    real = len(range(rank, n, world_size))  # the share's leading real samples; padding follows them
    if first + labels.shape[0] <= real:
        return labels
    labels = labels.clone()
    labels[max(real - first, 0) :] = PAD_LABEL
    return labels


def batches_per_epoch(n: int, batch_size: int, world_size: int, drop_last: bool) -> int:
    per_rank = n // world_size if drop_last else -(-n // world_size)
    return per_rank // batch_size if drop_last else -(-per_rank // batch_size)


def consumed(start: int | Position | None, batch_size: int, world_size: int) -> tuple[int, int]:
    """(samples of the epoch's permutation consumed, the batch number this rank continues at) at `start`: a batch
    number of this layout, or a checkpoint's Position (written by any layout)."""
    if isinstance(start, Position):
        return start.samples, start.samples // (batch_size * world_size)
    return (start or 0) * batch_size * world_size, start or 0


def resume_order(
    n: int,
    epoch: int,
    seed: int,
    shuffle: bool,
    rank: int,
    world_size: int,
    batch_size: int,
    drop_last: bool,
    start: int | Position | None,
    repeats: int = 1,
) -> tuple[torch.Tensor, int, int]:
    """(this rank's sample indices, the number of its first batch, how many batches) for `epoch` from `start`.

    After a resume the rest of the epoch's sequence is shared out over this run's ranks: the same samples an
    uninterrupted run sees on the same world size, and none already consumed on another one.
    """
    skip, first = consumed(start, batch_size, world_size)
    if not skip:
        index = epoch_order(n, epoch, seed, shuffle, rank, world_size, drop_last, repeats)
        return index, 0, batches_per_epoch(n, batch_size, world_size, drop_last)
    rest = epoch_sequence(n, epoch, seed, shuffle, repeats)[skip:]
    index = rest[: len(rest) - len(rest) % world_size][rank::world_size]
    return index, first, len(index) // batch_size


def batch_generator(seed: int, epoch: int, batch: int, rank: int = 0) -> torch.Generator:
    """One generator per batch (and rank), so augmentation after a resume matches the uninterrupted run."""
    return torch.Generator().manual_seed(seed * 1_000_003 + epoch * 10_007 + batch + rank * 1_000_000_007)


def loader_generator(seed: int, epoch: int, rank: int = 0) -> torch.Generator:
    """A DataLoader's own generator (torch draws its workers' base seed from it as it starts iterating, with no
    workers too). Without one it draws from the global RNG, which dropout and drop-path draw from: the DataLoader a
    resume makes for the rest of an epoch would shift every mask after it. Per rank, as the global RNG is."""
    return torch.Generator().manual_seed(hash((seed, epoch, rank)) & (2**63 - 1))


class PermutationPosition:
    """The resume arithmetic of a loader over one seeded permutation per epoch (needs data, seed, shuffle, rank,
    world_size, batch_size, drop_last): where it stands, and what it has left from a start."""

    repeats = 1  # data.repeated_aug: each image this many times in a row in the epoch's sequence

    def plan(self, epoch: int, start: int | Position | None) -> tuple[torch.Tensor, int, int]:
        return resume_order(len(self.data), epoch, self.seed, self.shuffle, self.rank, self.world_size,
                            self.batch_size, self.drop_last, start, self.repeats)  # fmt: skip

    def __len__(self) -> int:
        return self.batches_with(self.world_size)

    def batches_with(self, world_size: int) -> int:
        """How many batches an epoch has had the data been split over `world_size` replicas (len(self) at its own)."""
        return batches_per_epoch(len(self.data), self.batch_size, world_size, self.drop_last)

    def batches_left(self, start: int | Position | None = None) -> int:
        """How many batches `epoch(e, start)` yields."""
        return self.plan(0, start)[2]

    def position(self, epoch: int, start: int | Position | None, batches: int) -> Position:
        """Where this loader stands after `batches` more batches of `epoch` from `start`."""
        skip, _ = consumed(start, self.batch_size, self.world_size)
        return Position(epoch, skip + batches * self.batch_size * self.world_size)


class BatchLoader(PermutationPosition):
    """Yields (images, targets) on `device`; the order depends only on (seed, epoch), so a resume replays it."""

    def __init__(
        self,
        data: BatchSource,
        batch_size: int,
        augment: BatchAugment,
        device: torch.device,
        shuffle: bool,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = True,
        prefetch: int = 2,
        repeats: int = 1,
    ):
        self.data = data
        self.repeats = repeats
        self.batch_size = batch_size
        self.augment = augment
        self.device = device
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        self.prefetch = prefetch
        # Pinned host memory lets the copy to an accelerator run asynchronously (untested here: no GPU).
        self.pin = device.type == "cuda"

    def order(self, epoch: int) -> torch.Tensor:
        n = len(self.data)
        return epoch_order(n, epoch, self.seed, self.shuffle, self.rank, self.world_size, self.drop_last, self.repeats)

    def epoch(self, epoch: int, start: int | Position | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's batches of `epoch`, from batch `start` of this layout or from a checkpoint's Position."""
        index, first, count = self.plan(epoch, start)
        batches = (self._batch(index, epoch, b, first + b) for b in range(count))
        batches = in_background(batches, self.prefetch) if self.prefetch else batches
        return trace(batches, "train" if self.shuffle else "val")

    def _batch(self, index: torch.Tensor, epoch: int, b: int, number: int) -> tuple[torch.Tensor, torch.Tensor, list]:
        rows = index[b * self.batch_size : (b + 1) * self.batch_size]
        generator = batch_generator(self.seed, epoch, number, self.rank)
        images, labels = read_batch(self.data, rows, generator)
        labels = mask_padding(labels, b * self.batch_size, len(self.data), self.rank, self.world_size)
        if self.pin:
            images, labels = images.pin_memory(), labels.pin_memory()
        images = images.to(self.device, non_blocking=True)
        labels = labels.to(self.device, non_blocking=True)
        images, labels = self.augment(images, labels, generator)
        return images, labels, rows.tolist()


_DONE = object()


class _Raised:
    def __init__(self, exc: BaseException):
        self.exc = exc


# What a loader worker process imports once in the fork server (below), so that each worker starts without importing.
WORKER_MODULES = ["__main__", "vitrain.data.stream", "vitrain.data.plain"]


def worker_context() -> multiprocessing.context.BaseContext | None:
    """How DataLoader worker processes start: forked from a fork server where the platform has one (not Windows),
    else its default. Forking the training process itself can leave the worker hung before it runs a line: CPython
    without the fix of gh-112275 (3.11.7 here; fixed in 3.12 and later 3.9-3.11 releases) copies the interpreter's
    thread-state lock into the child as it was, and a thread of the training process may hold it at that moment (a
    C++ thread entering Python). A fork of a process with other threads is unsafe in general (POSIX); Python 3.14
    made the fork server its default on Linux. Seen here: a 2-rank DDP run (shards, one worker, async checkpoints)
    hung in its 14th 30-epoch run, the worker in PyOS_AfterFork_Child (results/loader-fork-hang). The fork server
    is a fresh single-threaded process that imports WORKER_MODULES once (`__main__`: a script that starts training
    must do so under `if __name__ == "__main__":`, as on macOS and Windows)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return None
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(WORKER_MODULES)
    return context


def _main_branch(test: ast.expr) -> str | None:
    """Which branch of an `if` runs only in the script as run, not where a worker imports it (as `__mp_main__`):
    "body" for `__name__ == "__main__"` (or `in`, or such a test joined by `and`), "orelse" for `!=`, `not in` or
    `not (...)`; None for any other test, or one that also lets "__mp_main__" in."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = _main_branch(test.operand)
        return {"body": "orelse", "orelse": "body"}.get(inner or "")
    if isinstance(test, ast.BoolOp):
        branches = [_main_branch(value) for value in test.values]
        if isinstance(test.op, ast.And) and "body" in branches:
            return "body"
        return "body" if all(b == "body" for b in branches) else None  # `or` of main tests alone
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return None
    sides = [test.left, *test.comparators]
    names = {node.id for side in sides for node in ast.walk(side) if isinstance(node, ast.Name)}
    texts = {node.value for side in sides for node in ast.walk(side) if isinstance(node, ast.Constant)}
    if "__name__" not in names or "__main__" not in texts or "__mp_main__" in texts:
        return None
    return {ast.Eq: "body", ast.In: "body", ast.NotEq: "orelse", ast.NotIn: "orelse"}.get(type(test.ops[0]))


def _main_case(statement: ast.stmt, case: ast.match_case) -> bool:
    """`match __name__:` ... `case "__main__":` (no guard on the case)."""
    subject, pattern = getattr(statement, "subject", None), case.pattern
    return (
        isinstance(subject, ast.Name)
        and subject.id == "__name__"
        and case.guard is None
        and isinstance(pattern, ast.MatchValue)
        and isinstance(pattern.value, ast.Constant)
        and pattern.value.value == "__main__"
    )


def _spans(node: ast.stmt, line: int) -> bool:
    return node.lineno <= line <= (node.end_lineno or node.lineno)


def _guarded(statement: ast.stmt, line: int) -> bool:
    """Whether `line` of a module-level `statement` runs only under `if __name__ == "__main__":` (or a match on
    `__name__`), at any depth of the compound statements around it."""
    if isinstance(statement, ast.If) and (branch := _main_branch(statement.test)):
        if any(_spans(s, line) for s in getattr(statement, branch)):
            return True
    for case in getattr(statement, "cases", []):
        if _main_case(statement, case) and any(_spans(s, line) for s in case.body):
            return True
    inner = [*getattr(statement, "body", []), *getattr(statement, "orelse", []), *getattr(statement, "finalbody", [])]
    inner += [s for handler in getattr(statement, "handlers", []) for s in handler.body]
    inner += [s for case in getattr(statement, "cases", []) for s in case.body]
    return any(_guarded(child, line) for child in inner if isinstance(child, ast.stmt) and _spans(child, line))


def unguarded_main_line() -> str | None:
    """Where ("file:line") the main script's top-level statement that the main thread is running now (it led here)
    is, when that statement is not under `if __name__ == "__main__":` and a worker started from the fork server (or
    by spawn) would import the script again, running it (multiprocessing's own rule: a script run by its path, or a
    module run with -m other than a package's __main__). None where that cannot happen or be read (a notebook, the
    vitrain command, a file that no longer parses)."""
    main = sys.modules.get("__main__")
    if main is None:
        return None
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    if spec_name == "__main__" or (spec_name or "").endswith(".__main__"):
        return None
    path = getattr(main, "__file__", None)
    if path is None:
        return None
    file = os.path.realpath(path)
    frame = sys._current_frames().get(threading.main_thread().ident or -1)  # the loader's thread may ask
    while frame is not None and not (
        frame.f_globals is vars(main)
        and frame.f_code.co_name == "<module>"
        and os.path.realpath(frame.f_code.co_filename) == file  # not code the script exec'd in its globals
    ):
        frame = frame.f_back
    if frame is None or frame.f_lineno is None:
        return None
    try:
        source = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return f"{path}:{frame.f_lineno}" if runs_on_import(source, frame.f_lineno) else None


def runs_on_import(source: str, line: int) -> bool:
    """Whether `line` of a script's `source` runs when the script is imported (not only under `if __name__ ==
    "__main__":`); False for a line in no top-level statement or a source that does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    return any(_spans(s, line) and not _guarded(s, line) for s in tree.body)


def check_workers_can_start(workers: int) -> None:
    """Refuse, before a loader with `workers` worker processes is made (and before anything is written), a script
    that started training at its top level: a worker imports the script and would run that training a second time,
    which Python stops with its long bootstrapping error (unguarded_main_line)."""
    where = unguarded_main_line() if workers else None
    if where is not None:
        raise ConfigError(
            f"{where} starts training at the script's top level, and data.loader_workers={workers} worker processes "
            'import the script (a fork server): put that call under `if __name__ == "__main__":`, or set '
            "data.loader_workers=0"
        )


def worker_start(workers: int) -> dict[str, Any]:
    """The loaders' DataLoader arguments for how `workers` worker processes start (none: nothing): from the fork
    server (worker_context), each ending when this, the training process, ends (_end_with)."""
    if not workers:
        return {}
    return {"multiprocessing_context": worker_context(), "worker_init_fn": functools.partial(_end_with, os.getpid())}


def from_workers(batches: Iterator[Any]) -> Iterator[Any]:
    """A DataLoader's batches, with an error of vitrain's raised in a worker re-raised as its own one line: torch
    re-raises it in this process with the worker's whole traceback as its message ("Caught DataError in DataLoader
    worker process 0. Original Traceback ...")."""
    try:
        yield from batches
    except VitrainError as exc:
        text = str(exc)
        if "Original Traceback" not in text:
            raise
        last = text.rstrip().splitlines()[-1]
        raise type(exc)(last.split(": ", 1)[1] if ": " in last else last) from None


def _end_with(training_pid: int, worker_id: int) -> None:
    """In a loader worker: exit as soon as the training process has ended, however it ended (SIGKILL too). A worker
    started from the fork server is the server's child, and the server stays up while a worker lives, so torch's
    own check (the worker's parent gone) never fires: a killed run would leave its workers, and their copies of its
    stdout and stderr, behind."""

    def watch() -> None:
        wait_for_end(training_pid)
        os._exit(0)

    threading.Thread(target=watch, name="vitrain-worker-watch", daemon=True).start()


def wait_for_end(pid: int, poll_s: float = 1.0) -> None:
    """Return once process `pid` has ended, counting a zombie (ended, not yet reaped) as ended: a parent that reads
    a killed child's pipes to their end reaps it only after the workers holding them are gone. Linux: a pidfd;
    macOS and the BSDs: kqueue's exit event; elsewhere (or an old kernel) a poll every `poll_s`."""
    try:
        handle = os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux 5.3+, or already gone
        handle = None
    if handle is not None:
        select.select([handle], [], [])
        os.close(handle)
        return
    if hasattr(select, "kqueue"):
        queue_ = select.kqueue()
        event = select.kevent(pid, select.KQ_FILTER_PROC, select.KQ_EV_ADD, select.KQ_NOTE_EXIT)
        try:
            queue_.control([event], 1, None)
        except OSError:  # no such process: already gone
            pass
        queue_.close()
        return
    while _running(pid):
        time.sleep(poll_s)


def _running(pid: int) -> bool:
    """Whether `pid` is a live process: it exists and (where /proc says) is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # ended just now, or no /proc to ask (macOS): os.kill found it
        return not Path("/proc").is_dir()
    return stat[stat.rindex(")") + 2] != "Z"  # the state follows the command name, which may hold spaces


def in_background(items: Iterator[Any], depth: int) -> Iterator[Any]:
    """Run `items` in a thread, at most `depth` ahead; errors re-raise here; closing early stops the thread.

    A thread (not a process) is enough: reading a memory map, torch copies and augmentation release the GIL.
    On CUDA the thread enqueues on the same current stream as the step, so the order of work stays correct.
    """
    slots: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                slots.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(item):
                    return
        except BaseException as exc:
            put(_Raised(exc))
            return
        put(_DONE)

    thread = threading.Thread(target=produce, name="vitrain-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = slots.get()
            if item is _DONE:
                return
            if isinstance(item, _Raised):
                raise item.exc
            yield item
    finally:
        stop.set()
        thread.join()


class WaitTimer:
    """Wraps a batch iterator and adds up the seconds its consumer spends blocked waiting for the next batch."""

    def __init__(self, batches: Iterator[Any]):
        self.batches = batches
        self.waited_s = 0.0

    def __iter__(self) -> WaitTimer:
        return self

    def __next__(self) -> Any:
        start = time.perf_counter()
        try:
            return next(self.batches)
        finally:
            self.waited_s += time.perf_counter() - start

    def take(self) -> float:
        """Seconds waited since the last call."""
        waited, self.waited_s = self.waited_s, 0.0
        return waited


def endless(loader: Any) -> Iterator[Any]:
    """A loader's batches, epoch after epoch (epoch 0, 1, ...): what a benchmark or lr-find steps through."""
    epoch = 0
    while True:
        yield from loader.epoch(epoch)
        epoch += 1


def first_batch(loader: Any) -> Any:
    """The loader's first batch of epoch 0 (its prefetch thread stopped after), left out of VITRAIN_SAMPLE_TRACE."""
    batches = loader.epoch(0)
    untraced = _UNTRACED.set(True)
    try:
        return next(iter(batches))
    finally:
        _UNTRACED.reset(untraced)
        getattr(batches, "close", lambda: None)()
