"""Runs on a shared cluster: stop signals agreed by all ranks, SLURM requeue, the step watchdog, async checkpoints."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, TINY, model_overrides
from tests.data_helpers import TREE_MODEL, write_shards
from tests.distributed_helpers import MODEL, free_port, gpu_free_env, losses, tiny_config
from vitrain import checkpoint as ckpt
from vitrain.config import config_from_dict, load_config
from vitrain.data.loader import TRACE_ENV
from vitrain.engine import Trainer, cluster
from vitrain.errors import ConfigError
from vitrain.models import create_model

RUNNER = REPO / "tests" / "fault_runner.py"
SYNTHETIC = [
    *model_overrides(MODEL), "data.source=synthetic", "data.synthetic_samples=64", "train.batch_size=8",
    "train.threads=1", "precision.mode=fp32", "log.progress=false", "log.every_steps=1", "parallel.strategy=ddp",
]  # fmt: skip


def torchrun(fault: str, *args: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    """Two ranks under torchrun, each running `vitrain train ARGS` with `fault` injected (tests/fault_runner.py)."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--monitor-interval=0.1", "--no-python", sys.executable, str(RUNNER), fault, "train", *args,
    ]  # fmt: skip
    env = {**os.environ, **gpu_free_env(2), **(env or {})}
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    step = ckpt.latest(run_dir)
    model = create_model(config_from_dict(ckpt.read_meta(step)["config"]).model)
    ckpt.load_model_weights(step, model)
    return model.state_dict()


def same_weights(a: Path, b: Path) -> bool:
    want, got = final_weights(a), final_weights(b)
    return all(torch.equal(got[k], v) for k, v in want.items())


def fake_scontrol(tmp_path: Path, state: str = "RUNNING") -> tuple[dict[str, str], Path]:
    """A stand-in `scontrol` first on the PATH that records its arguments; SLURM's variables of job 4242."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol.calls"
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "scontrol"
    script.write_text(
        f'#!/bin/sh\necho "$@" >> {calls}\n[ "$1" = show ] && echo "JobId=4242 JobState={state} Restarts=0"\nexit 0\n'
    )
    script.chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "0"}
    return env, calls


# ---------------------------------------------------------------------------------------------- one process


def test_stop_signals_must_be_catchable_and_timeouts_positive(tmp_path):
    with pytest.raises(ConfigError, match="run.stop_signals: SIGKILL is not a signal a process can catch"):
        load_config(overrides=["run.stop_signals=[SIGTERM,SIGKILL]"])
    with pytest.raises(ConfigError, match="run.stop_signals: SIGTERMM"):
        load_config(overrides=["run.stop_signals=[SIGTERMM]"])
    with pytest.raises(ConfigError, match="run.collective_timeout_s=0 must be positive"):
        load_config(overrides=["run.collective_timeout_s=0"])
    with pytest.raises(ConfigError, match="train.checkpoint_async writes DCP checkpoints in the background"):
        load_config(overrides=["train.engine=deepspeed", "parallel.strategy=ddp", "train.checkpoint_async=true"])


def test_requeue_is_asked_of_slurm_only_inside_a_job_and_not_for_a_cancelled_one(tmp_path, monkeypatch):
    env, calls = fake_scontrol(tmp_path)
    monkeypatch.setenv("PATH", env["PATH"])
    assert "not a SLURM job" in cluster.requeue({})
    assert not calls.exists()
    assert cluster.requeue({"SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "3", "SLURM_JOB_ID": "9"}).startswith(
        "requeued SLURM job 7_3"
    )
    assert calls.read_text().splitlines() == ["show job 7_3", "requeue 7_3"]
    cancelled_env, cancelled_calls = fake_scontrol(tmp_path / "c", state="CANCELLED")
    monkeypatch.setenv("PATH", cancelled_env["PATH"])
    assert "was cancelled" in cluster.requeue(cancelled_env)
    assert cancelled_calls.read_text().splitlines() == ["show job 4242"]
    assert cluster.requeued({"SLURM_JOB_ID": "1", "SLURM_RESTART_COUNT": "2"})
    assert not cluster.requeued({"SLURM_JOB_ID": "1", "SLURM_RESTART_COUNT": "0"}) and not cluster.requeued({})


# slow: 27 s on a Zen 4; the SIGTERM test continues bit for bit, a run preempted in set-up requeues (default suite)
@pytest.mark.slow
def test_a_stopped_run_requeues_once_and_the_same_command_continues_it_to_the_uninterrupted_weights(tmp_path):
    env, calls = fake_scontrol(tmp_path)
    common = [*SYNTHETIC, "parallel.strategy=single", "train.epochs=2", f"log.out_dir={tmp_path}", "run.requeue=true"]

    def run(fault: str, name: str, extra_env: dict) -> subprocess.CompletedProcess:
        command = [sys.executable, str(RUNNER), fault, "train", *common, f"name={name}"]
        return subprocess.run(command, cwd=REPO, capture_output=True, text=True, env={**os.environ, **extra_env})

    assert run("none", "reference", {}).returncode == 0
    stopped = run("term:0:4:0", "victim", env)
    assert stopped.returncode == cluster.EXIT_STOPPED, stopped.stderr
    assert "stopped by SIGTERM at step 4" in stopped.stderr.strip().splitlines()[-1]
    assert calls.read_text().splitlines() == ["show job 4242", "requeue 4242"]
    run_file = json.loads((tmp_path / "victim" / "run.json").read_text())
    assert run_file["stopped"] == {"step": 4, "signal": "SIGTERM"}
    # The requeued job is preempted again while it loads the checkpoint: it stops there, requeued once more, with
    # the run folder as it was.
    files = {p: p.read_bytes() for p in (tmp_path / "victim").rglob("*") if p.is_file()}
    stopped_on_load = run("term_load:0", "victim", {**env, "SLURM_RESTART_COUNT": "1"})
    assert stopped_on_load.returncode == cluster.EXIT_STOPPED, stopped_on_load.stderr
    assert "stopped by SIGTERM at step 4 (checkpoint" in stopped_on_load.stderr.strip().splitlines()[-1]
    assert calls.read_text().splitlines() == ["show job 4242", "requeue 4242"] * 2
    assert {p: p.read_bytes() for p in (tmp_path / "victim").rglob("*") if p.is_file()} == files
    # The requeued job: the same command, SLURM_RESTART_COUNT=1.
    again = run("none", "victim", {**env, "SLURM_RESTART_COUNT": "1"})
    assert again.returncode == 0, again.stderr
    assert "was stopped by SIGTERM after step 4: continuing it" in again.stderr
    assert not (tmp_path / "victim-1").exists()
    assert "stopped" not in json.loads((tmp_path / "victim" / "run.json").read_text())
    assert losses(tmp_path / "victim") == losses(tmp_path / "reference")
    assert same_weights(tmp_path / "reference", tmp_path / "victim")


# term_load:0 is slow (34 s on a Zen 4): term_setup:0 stops the run before its first step in the default run
@pytest.mark.parametrize("fault", [pytest.param("term_load:0", marks=pytest.mark.slow), "term_setup:0"])
def test_a_run_preempted_before_its_first_step_is_marked_stopped_so_another_job_continues_it(tmp_path, fault):
    """Killed in SLURM job 4242, requeued, preempted while the trainer is set up (term_setup) or its checkpoint
    loads (term_load): run.json had only the job's id, so a later job of another id running the same command would
    have started a new run; the stop marks the run stopped, at the checkpoint's step, and changes nothing else."""
    common = [*SYNTHETIC, "parallel.strategy=single", "train.checkpoint_every_steps=2", f"log.out_dir={tmp_path}",
              "name=victim"]  # fmt: skip

    def run(fault: str, env: dict) -> subprocess.CompletedProcess:
        command = [sys.executable, str(RUNNER), fault, "train", *common]
        return subprocess.run(command, cwd=REPO, capture_output=True, text=True, env={**os.environ, **env})

    job = {"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "0"}
    killed = run("kill_step:0:5", job)
    assert killed.returncode == -9, killed.stderr
    run_file = json.loads((tmp_path / "victim" / "run.json").read_text())
    assert "stopped" not in run_file
    # run.json records the stop; .lock names the process holding the run (vitrain/engine/runs.py): nothing else changes
    unchanged = lambda p: p.is_file() and p.name not in ("run.json", ".lock")  # noqa: E731
    files = {p: p.read_bytes() for p in (tmp_path / "victim").rglob("*") if unchanged(p)}
    preempted = run(fault, {**job, "SLURM_RESTART_COUNT": "1"})
    assert preempted.returncode == cluster.EXIT_STOPPED, preempted.stderr
    assert "SIGTERM: stopping before the first step (nothing new to save)" in preempted.stderr
    assert "stopped by SIGTERM at step 4 (checkpoint" in preempted.stderr.strip().splitlines()[-1]
    assert json.loads((tmp_path / "victim" / "run.json").read_text()) == {
        **run_file,
        "stopped": {"step": 4, "signal": "SIGTERM"},
    }
    assert {p: p.read_bytes() for p in (tmp_path / "victim").rglob("*") if unchanged(p)} == files
    again = run("none", {"SLURM_JOB_ID": "5555", "SLURM_RESTART_COUNT": "0"})
    assert again.returncode == 0, again.stderr
    assert "was stopped by SIGTERM after step 4" in again.stderr and not (tmp_path / "victim-1").exists()
    assert str(cluster.Stopped("SIGTERM", 0, None)) == (
        "stopped by SIGTERM before the first step (nothing saved); run the same command again to start the run"
    )


def test_a_new_run_preempted_while_it_is_set_up_writes_nothing_and_requeues(tmp_path):
    """Before fit(): the data, the autotune race and the engine's build. Without the set-up's stop signals the
    process died of the SIGTERM (-15), and the job was not requeued."""
    env, calls = fake_scontrol(tmp_path)
    command = [sys.executable, str(RUNNER), "term_setup:0", "train", *SYNTHETIC, "parallel.strategy=single",
               f"log.out_dir={tmp_path}", "name=fresh", "run.requeue=true"]  # fmt: skip
    stopped = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env={**os.environ, **env})
    assert stopped.returncode == cluster.EXIT_STOPPED, stopped.stderr
    assert stopped.stderr.strip().splitlines()[-1] == (
        "vitrain: stopped by SIGTERM before the first step (nothing saved); run the same command again to start the run"
    )
    assert calls.read_text().splitlines() == ["show job 4242", "requeue 4242"]
    assert not (tmp_path / "fresh").exists()


def test_resume_auto_starts_a_missing_run_and_continues_an_existing_one(tmp_path):
    first = Trainer(tiny_config(tmp_path, "auto"), resume="auto")
    assert first.is_new_run and first.resume_path is None
    first.fit()
    first.close()
    again = Trainer(tiny_config(tmp_path, "auto", train={"max_steps": 8}), resume="auto")
    assert again.run_dir == tmp_path / "auto" and again.resume_path == ckpt.latest(tmp_path / "auto")


def test_an_async_checkpoint_holds_the_weights_of_its_step_while_training_goes_on(tmp_path):
    cfg = tiny_config(tmp_path, "async", train={"max_steps": 3, "checkpoint_async": True})
    trainer = Trainer(cfg)
    trainer.fit()
    engine = trainer.engine
    before = {k: v.cpu().clone() for k, v in trainer.model.state_dict().items()}  # the model may be on a GPU
    trainer.step += 1
    path = trainer.save()
    with torch.no_grad():  # training goes on while the files are written: the checkpoint keeps the step's weights
        for p in trainer.model.parameters():
            p.add_(1.0)
    assert engine.pending is not None
    assert trainer.engine.wait_for_save() == path and ckpt.is_complete(path)
    model = create_model(cfg.model)
    ckpt.load_model_weights(path, model)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    trainer.close()


def test_async_staging_buffers_are_made_after_the_first_step_and_reused_by_every_save(tmp_path):
    cfg = tiny_config(tmp_path, "staging", train={"max_steps": 1, "checkpoint_async": True})
    trainer = Trainer(cfg)
    trainer.fit()  # its one step started the buffers; its final save waited for them and copied into them
    staging = trainer.engine.staging
    assert staging.preparing is None and staging.layout is not None
    buffers = [t.data_ptr() for t in ckpt._local_tensors(staging.buffers)]
    trainer.step += 1
    trainer.save()
    trainer.engine.wait_for_save()
    assert [t.data_ptr() for t in ckpt._local_tensors(staging.buffers)] == buffers  # the same memory, refilled
    state = ckpt.state_to_save(trainer.model, trainer.engine.optimizer, {})
    staging.prepare({"other": torch.ones(3)})  # a state of another layout: the next save stages it into new buffers
    staged = staging.stage(state)
    assert staging.preparing is None and staged["model"].keys() == state["model"].keys()
    assert all(torch.equal(staged["model"][k].cpu(), v.cpu()) for k, v in state["model"].items())
    trainer.close()


@pytest.mark.slow  # the default suite keeps async saves on one process and on two DDP ranks
def test_async_checkpoints_under_zero3_resume_to_the_weights_of_sync_ones(tmp_path):
    """FSDP2's sharded tensors staged into kept buffers, saved three times; a resume from the async run's
    mid-run checkpoint ends where the sync run does."""
    args = [*SYNTHETIC, "parallel.strategy=zero3", "train.epochs=3", "train.checkpoint_every_steps=2",
            "train.keep_checkpoints=10", f"log.out_dir={tmp_path}"]  # fmt: skip
    assert torchrun("none", *args, "name=sync").returncode == 0
    done = torchrun("none", *args, "name=async", "train.checkpoint_async=true")
    assert done.returncode == 0, done.stderr[-3000:]
    assert [p.name for p in ckpt.step_dirs(tmp_path / "sync")] == [p.name for p in ckpt.step_dirs(tmp_path / "async")]
    for step in ckpt.step_dirs(tmp_path / "async"):
        ckpt.verify(step)
    assert same_weights(tmp_path / "sync", tmp_path / "async")
    resumed = torchrun("none", *args, "name=async", f"--resume={tmp_path / 'async' / 'checkpoints' / 'step_00000004'}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert same_weights(tmp_path / "sync", tmp_path / "async")


# ---------------------------------------------------------------------------------------------- two ranks


def test_sigterm_to_one_rank_stops_both_after_one_step_and_the_same_command_continues_bit_for_bit(tmp_path):
    """The shards source with a loader worker per rank; SIGTERM to rank 1's process group (as torchrun sends it)."""
    write_shards(tmp_path / "shards", [16, 16, 16, 16])
    common = [
        *TINY, *TREE_MODEL, "data.mean=[0.5,0.5,0.5]", "data.std=[0.5,0.5,0.5]", "data.source=shards",
        f"data.root={tmp_path / 'shards'}", "data.loader_workers=1", "data.shuffle_buffer=6", "data.hflip=0.5",
        "train.batch_size=4", "train.epochs=2", "train.threads=1", "parallel.strategy=ddp",
        "train.checkpoint_async=true", f"log.out_dir={tmp_path}/runs",
        # A hang ends well inside the test's timeout, with every thread's stack (the watchdog) or the collective's
        # error: one resumed run here hung once after epoch 1's evaluation, with nothing to go on.
        "run.watchdog_min_s=60", "run.collective_timeout_s=90",
    ]  # fmt: skip

    def run(fault: str, name: str, trace: str) -> subprocess.CompletedProcess:
        return torchrun(fault, *common, f"name={name}", env={TRACE_ENV: str(tmp_path / trace)})

    def said(done: subprocess.CompletedProcess) -> str:  # its stderr's end and the watchdog's stacks, if any
        stacks = sorted((tmp_path / "runs").glob("*/stacks-rank*.txt"))
        return done.stderr[-3000:] + "".join(f"\n{p}:\n{p.read_text()[-3000:]}" for p in stacks)

    reference = run("none", "reference", "reference.txt")
    assert reference.returncode == 0, said(reference)
    stopped = run("term:1:3:0", "victim", "stopped.txt")
    stops = re.findall(r"stopped by SIGTERM at step (\d+)", stopped.stderr)
    assert len(stops) == 2 and stops[0] == stops[1] and stops[0] in ("3", "4"), stopped.stderr[-3000:]
    assert re.search(rf"exitcode\s*:\s*{cluster.EXIT_STOPPED}", stopped.stderr)  # torchrun's report of the ranks
    step = int(stops[0])
    run_dir = tmp_path / "runs" / "victim"
    assert [p.name for p in ckpt.step_dirs(run_dir)] == [f"step_{step:08d}"]  # one checkpoint: the stop's
    assert ckpt.read_meta(ckpt.latest(run_dir))["loader"]["segments"]  # the stream's position is in it
    resumed = run("none", "victim", "resumed.txt")  # the same command
    assert resumed.returncode == 0, said(resumed)
    assert f"resumed from {ckpt.latest(run_dir).parent / f'step_{step:08d}'} at step {step}" in resumed.stderr

    def train_lines(*names: str) -> list[str]:
        lines = [line for n in names for line in (tmp_path / n).read_text().splitlines() if line.startswith("train")]
        return sorted(lines)  # both ranks append to one file: compared as a multiset of batches

    assert train_lines("stopped.txt", "resumed.txt") == train_lines("reference.txt")
    assert losses(run_dir) == losses(tmp_path / "runs" / "reference")
    assert same_weights(tmp_path / "runs" / "reference", run_dir)


def test_a_rank_stuck_in_a_step_ends_the_job_within_the_watchdog_deadline_with_every_stack(tmp_path):
    args = [*SYNTHETIC, "train.epochs=20", f"log.out_dir={tmp_path}", "name=stuck", "run.watchdog_min_s=4"]
    fault_log = tmp_path / "fault"
    done = torchrun("stall:1:6:120", *args, env={"VITRAIN_FAULT_LOG": str(fault_log)}, timeout=120)
    stalled_at = float((tmp_path / "fault.1").read_text().split()[0])
    ended = max(p.stat().st_mtime for p in (tmp_path / "stuck").glob("stacks-rank*.txt"))
    assert done.returncode != 0 and ended - stalled_at < 30, (ended - stalled_at, done.stderr[-2000:])
    assert re.search(rf"exitcode\s*:\s*{cluster.EXIT_HUNG}", done.stderr)
    for rank in range(2):
        assert f"rank {rank}: watchdog: no step completed in" in done.stderr
        assert "in _fit" in (tmp_path / "stuck" / f"stacks-rank{rank}.txt").read_text()  # the training loop's frame
    assert "fault_runner.py" in (tmp_path / "stuck" / "stacks-rank1.txt").read_text()  # asleep in its step
    assert "in all_reduce" in (tmp_path / "stuck" / "stacks-rank0.txt").read_text()  # waiting for rank 1
    assert "watchdog: no step completed" in (tmp_path / "stuck" / "log.txt").read_text()
    pattern = f"log.out_dir={tmp_path}"  # this test's processes only
    leftover = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    assert leftover == [], "processes of the hung job were left behind"


# slow: 9 s on a Zen 4
@pytest.mark.slow
def test_a_second_signal_during_the_stop_save_changes_nothing(tmp_path):
    args = [*SYNTHETIC, "train.epochs=2", f"log.out_dir={tmp_path}", "name=twice"]
    done = torchrun("term_twice:all:2", *args)
    assert "SIGTERM again: already writing the stop checkpoint" in done.stderr
    assert re.findall(r"stopped by SIGTERM at step (\d+)", done.stderr) == ["2", "2"], done.stderr[-3000:]
    assert ckpt.is_complete(ckpt.latest(tmp_path / "twice"))


AFTER_STOP = """
import os, signal, sys, time
from vitrain.engine.cluster import StopSignals, Stopped
stop, said = sys.argv[1] == "stop", sys.argv[2] == "said"
try:
    with StopSignals(("SIGUSR1",)) as signals:
        if stop:  # what the trainer's stop path does once its checkpoint is written
            signals.stopped = Stopped("SIGUSR1", 3, None)
            raise signals.stopped
except Stopped as stopped:
    if said:  # the CLI printed it
        print(f"vitrain: {stopped}", file=sys.stderr)
        stopped.said = True
os.kill(os.getpid(), signal.SIGUSR1)  # a launcher's signal while the process tears down
time.sleep(10)
print("still running")
"""


@pytest.mark.parametrize(
    "stop, said, launched", [("stop", "unsaid", True), ("stop", "said", True), ("no-stop", "unsaid", True),
                             ("stop", "said", False)]
)  # fmt: skip
def test_a_stop_signal_after_the_stop_ends_the_process_with_the_stops_code_and_one_line(stop, said, launched):
    # torchrun signals the ranks still tearing down as soon as one exits: after a stop that must not end them by the
    # signal's default action (no stop line, the signal's status); without a stop the previous handler is back, and
    # so it is after a stop in a process no launcher runs (a notebook's kernel: its Ctrl-C must not end it).
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")}
    if launched:
        env["TORCHELASTIC_RUN_ID"] = "test"
    done = subprocess.run(
        [sys.executable, "-c", AFTER_STOP, stop, said], capture_output=True, text=True, timeout=60, env=env
    )
    if stop == "no-stop" or not launched:
        assert done.returncode == -signal.SIGUSR1 and done.stderr.count("stopped by") == (not launched)
        return
    assert done.returncode == cluster.EXIT_STOPPED and "still running" not in done.stdout, done.stderr[-2000:]
    assert done.stderr.count("vitrain: stopped by SIGUSR1 at step 3 (nothing new to save)") == 1, done.stderr


SET_UP_INTERRUPTED = """
import signal, sys
from vitrain.engine.cluster import StopSignals
try:
    with StopSignals(("SIGTERM", "SIGINT"), starting=True, interrupt_again=True) as signals:
        for name in sys.argv[1:]:
            signal.raise_signal(signal.Signals[name])
        print("set up", signals.received.name)
except KeyboardInterrupt:
    print("interrupted")
"""


@pytest.mark.parametrize(
    "sent, printed",
    [("SIGINT", "set up SIGINT"), ("SIGTERM SIGTERM", "set up SIGTERM"), ("SIGINT SIGINT", "interrupted"),
     ("SIGTERM SIGINT", "interrupted")],
)  # fmt: skip
def test_ctrl_c_twice_interrupts_the_set_up_at_once_and_other_signals_twice_stop_it(sent, printed):
    # The set-up writes nothing, so a second Ctrl-C need not wait for its next check; a preemption's SIGTERM may come
    # from both the launcher and SLURM, and must still stop the run (exit 75, requeued) at that check.
    done = subprocess.run([sys.executable, "-c", SET_UP_INTERRUPTED, *sent.split()], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == printed, done.stderr


@pytest.mark.slow
def test_sigkill_during_the_stop_save_keeps_the_previous_checkpoint_as_the_resume_point(tmp_path):
    args = [*SYNTHETIC, "train.epochs=2", "train.checkpoint_every_steps=2", f"log.out_dir={tmp_path}", "name=k"]
    done = torchrun("term_kill:0:3:4", *args)
    assert done.returncode != 0
    assert [p.name for p in ckpt.step_dirs(tmp_path / "k")] == ["step_00000002"]
    resumed = torchrun("none", *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stderr and "at step 2" in resumed.stderr


@pytest.mark.slow
def test_two_launchers_as_two_nodes_train_resume_and_fail_together(tmp_path):
    """Two `torchrun --nnodes 2` launchers with a c10d rendezvous on 127.0.0.1, as docs/cluster.md has users start
    them on two machines: they train the digits recipe and resume; when one node is gone (launcher and worker
    killed), the other exits non-zero within the collective timeout instead of waiting; when only a launcher is
    killed, its worker stops with it (SIGTERM) and both ranks write the stop checkpoint."""

    def launch(name: str, *extra: str, port: int) -> list[subprocess.Popen]:
        args = ["digits", "train.epochs=2", "train.threads=1", "model.depth=1", "model.width=32",
                "parallel.strategy=ddp", "log.progress=false", f"log.out_dir={tmp_path}", f"name={name}",
                "run.collective_timeout_s=20", *extra]  # fmt: skip
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", name,
            "--monitor-interval=0.1", "-m", "vitrain", "train", *args,
        ]  # fmt: skip
        logs = [open(tmp_path / f"{name}-{node}.log", "w") for node in range(2)]
        env = {**os.environ, **gpu_free_env(2)}  # one GPU: both nodes on the CPU
        return [
            subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
            for log in logs
        ]

    nodes = launch("two", port=free_port())
    assert [p.wait(timeout=300) for p in nodes] == [0, 0], (tmp_path / "two-0.log").read_text()[-3000:]
    steps = json.loads((tmp_path / "two" / "summary.json").read_text())["steps"]
    again = launch("two", "train.epochs=3", "--resume", port=free_port())
    assert [p.wait(timeout=300) for p in again] == [0, 0], (tmp_path / "two-0.log").read_text()[-3000:]
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["steps"] == steps * 3 // 2
    assert f"at step {steps}" in (tmp_path / "two" / "log.txt").read_text()  # resumed where it ended

    victim = launch("kill", "train.epochs=50", port=free_port())
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (tmp_path / "kill" / "metrics.jsonl").exists():
        time.sleep(0.2)
    time.sleep(2)  # training
    workers = subprocess.run(["pgrep", "-P", str(victim[1].pid)], capture_output=True, text=True).stdout.split()
    for pid in [victim[1].pid, *map(int, workers)]:  # one node gone: its launcher and its worker
        os.killpg(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    code = victim[0].wait(timeout=120)
    assert code != 0 and time.monotonic() - killed_at < 40, (tmp_path / "kill-0.log").read_text()[-3000:]
    assert "stopped" not in json.loads((tmp_path / "kill" / "run.json").read_text())

    orphaned = launch("orphan", "train.epochs=50", port=free_port())
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (tmp_path / "orphan" / "metrics.jsonl").exists():
        time.sleep(0.2)
    time.sleep(2)
    os.kill(orphaned[1].pid, signal.SIGKILL)  # the launcher only: its worker is told by the kernel (SIGTERM)
    code = orphaned[0].wait(timeout=120)
    assert code != 0, (tmp_path / "orphan-0.log").read_text()[-3000:]
    assert json.loads((tmp_path / "orphan" / "run.json").read_text())["stopped"]["signal"] == "SIGTERM"
    assert ckpt.is_complete(ckpt.latest(tmp_path / "orphan"))


# ---------------------------------------------------------------------------------------------- the torture test

TORTURE = [
    *model_overrides(MODEL), "model.drop_path=0.1", "model.dropout=0.1", "data.source=synthetic",
    "data.synthetic_samples=160", "data.crop_padding=2", "data.hflip=0.5", "train.batch_size=8", "train.epochs=18",
    "train.threads=1", "train.checkpoint_every_steps=3", "train.keep_checkpoints=2", "precision.mode=fp32",
    "log.progress=false", "log.every_steps=5", "parallel.strategy=ddp", "run.watchdog_min_s=10",
]  # fmt: skip
KINDS = ("kill_one", "term_all", "term_one", "stall", "term_twice", "term_kill")


@pytest.mark.slow
def test_torture_20_interruptions_of_a_two_rank_run_then_the_weights_of_an_uninterrupted_one(tmp_path):
    """SIGKILL of one rank, SIGTERM to all or to one, a rank stuck in a step, a second signal during the stop save,
    SIGKILL during it: 20 of them at random, each followed by the same command (`--resume auto`); the final weights
    equal an uninterrupted run's bit for bit, and a graceful stop loses at most the step in flight."""
    import random

    common = [*TORTURE, f"log.out_dir={tmp_path}"]
    reference = torchrun("none", *common, "name=reference")
    assert reference.returncode == 0, reference.stderr[-3000:]
    steps = json.loads((tmp_path / "reference" / "summary.json").read_text())["steps"]
    rng = random.Random(2026)
    plan = [*KINDS, *KINDS, *KINDS, *rng.choices(KINDS, k=2)]
    rng.shuffle(plan)
    fault_log = tmp_path / "fault"
    history = []
    for kind in plan:
        at, rank = rng.randint(2, 6), rng.randint(0, 1)
        fault = {
            "kill_one": f"kill_step:{rank}:{at}", "term_all": f"term:all:{at}:{rng.randint(0, 40)}",
            "term_one": f"term:{rank}:{at}:{rng.randint(0, 40)}", "stall": f"stall:{rank}:{at}:120",
            "term_twice": f"term_twice:all:{at}", "term_kill": f"term_kill:0:{at}:{rng.randint(1, 6)}",
        }[kind]  # fmt: skip
        for old in tmp_path.glob("fault.*"):
            old.unlink()
        done = torchrun(fault, *common, "name=victim", "--resume", "auto", env={"VITRAIN_FAULT_LOG": str(fault_log)})
        history.append(fault)
        assert done.returncode != 0, f"{history}: the fault did not land, the run ended"
        began = re.search(r"resumed from \S+ at step (\d+)", done.stderr)
        start = int(began.group(1)) if began else 0
        stops = {int(s) for s in re.findall(r"stopped by SIGTERM at step (\d+)", done.stderr)}
        if kind in ("term_all", "term_one", "term_twice"):
            # Steps done just before and just after each rank's signal was sent (fault_runner); the first signal
            # stops every rank after the step it lands in, or at the boundary it lands before.
            fired = [[int(n) for n in p.read_text().split()[2:4]] for p in tmp_path.glob("fault.*")]
            lo, hi = start + min(b for b, _ in fired), start + min(a for _, a in fired) + 1
            assert len(stops) == 1 and lo <= min(stops) <= hi, (history, stops, start, fired)
            assert re.search(rf"exitcode\s*:\s*{cluster.EXIT_STOPPED}", done.stderr), history
        if kind == "stall":
            assert re.search(rf"exitcode\s*:\s*{cluster.EXIT_HUNG}", done.stderr), (history, done.stderr[-2000:])
    finished = torchrun("none", *common, "name=victim", "--resume", "auto")
    assert finished.returncode == 0, f"after {history}: {finished.stderr[-3000:]}"
    assert json.loads((tmp_path / "victim" / "summary.json").read_text())["steps"] == steps
    assert same_weights(tmp_path / "reference", tmp_path / "victim"), history


def test_the_same_command_continues_the_stopped_or_this_jobs_run_among_runs_of_one_name(tmp_path):
    from vitrain.engine.runs import resume_choice

    base = tmp_path / "r"
    for name, record in [("r", {}), ("r-1", {"stopped": {"step": 3, "signal": "SIGTERM"}}), ("r-2", {})]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "run.json").write_text(json.dumps(record))
    assert resume_choice(base, False, {}) == str(tmp_path / "r-1")  # the stopped one, not the base
    (tmp_path / "r-2" / "run.json").write_text(json.dumps({"slurm_job": "77"}))
    requeued = {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"}
    assert resume_choice(base, False, requeued) == str(tmp_path / "r-2")  # the folder this job wrote
    (tmp_path / "r-1" / "run.json").write_text("{}")
    assert resume_choice(base, False, {}) is False  # nothing stopped: a new run (r-3)
    assert resume_choice(tmp_path / "new", False, requeued) is False  # a requeued job that wrote nothing yet
    assert resume_choice(base, "auto", {}) is True
