"""The SLURM example and docs/cluster.md agree with themselves and with the config (no training, no SLURM)."""

from __future__ import annotations

import dataclasses
import re
import shutil
import signal
import subprocess

import pytest

from tests.conftest import REPO
from vitrain.config import Config, RunConfig

SBATCH = REPO / "examples" / "slurm" / "train.sbatch"
CLUSTER_DOC = REPO / "docs" / "cluster.md"

# $NAME and ${NAME...}; positional and special parameters ($@, $1, $?, $$) and $(...) are not names.
VARIABLE_USE = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)")
# A header line naming a variable: "#   NAME   its meaning".
HEADER_NAME = re.compile(r"^#\s+([A-Z][A-Z0-9_]*)\s{2,}\S")


def script_lines() -> list[str]:
    return SBATCH.read_text().splitlines()


def header_names() -> list[str]:
    """The variables the comment block at the top of the script names (it ends at the first command)."""
    names = []
    for line in script_lines():
        if not line.startswith("#"):
            break
        if match := HEADER_NAME.match(line):
            names.append(match.group(1))
    return names


def used_names() -> set[str]:
    """Every variable the script's commands read or set."""
    commands = [line for line in script_lines() if not line.lstrip().startswith("#")]
    used = set()
    for line in commands:
        used.update(VARIABLE_USE.findall(line))
        used.update(re.findall(r"(?:^|[\s;|&])([A-Z_][A-Z0-9_]*)=", line))
    return used


def sbatch_option(name: str) -> str:
    values = [line.split("=", 1)[1] for line in script_lines() if line.startswith(f"#SBATCH --{name}=")]
    assert len(values) == 1, f"expected one #SBATCH --{name}= line, found {values}"
    return values[0]


def torchrun_option(name: str) -> str:
    match = re.search(rf"--{name}[ =](\S+)", SBATCH.read_text())
    assert match, f"the torchrun line has no --{name}"
    return match.group(1)


def signal_name(text: str) -> str:
    """USR1, SIGUSR1 or 10 -> SIGUSR1."""
    return signal.Signals(int(text)).name if text.isdigit() else "SIG" + text.upper().removeprefix("SIG")


def test_the_script_parses_under_bash():
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("bash is not installed")
    result = subprocess.run([bash, "-n", str(SBATCH)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_variable_the_script_uses_is_named_in_its_header():
    assert used_names() - set(header_names()) == set()


def test_every_variable_the_header_names_is_used_by_the_script_and_named_once():
    names = header_names()
    assert names, "the header names no variables"
    assert len(names) == len(set(names)), names
    assert set(names) - used_names() == set()


def test_the_signal_is_sent_to_the_job_steps_and_not_only_the_batch_shell():
    assert not sbatch_option("signal").startswith("B:"), "B: would signal only the batch shell, not torchrun"


def test_torchrun_forwards_the_signal_slurm_sends():
    sent = signal_name(sbatch_option("signal").split(":")[-1].split("@")[0])
    forwarded = {signal_name(name) for name in torchrun_option("signals-to-handle").split(",")}
    assert sent in forwarded


def test_vitrain_stops_on_the_signal_slurm_sends_by_default():
    sent = signal_name(sbatch_option("signal").split(":")[-1].split("@")[0])
    assert sent in Config().run.stop_signals


def test_torchrun_shutdown_timeout_ends_before_slurm_kills_the_job():
    lead_s = int(sbatch_option("signal").split("@")[1])
    shutdown_s = float(torchrun_option("shutdown-timeout"))
    assert 0 < shutdown_s < lead_s


def test_the_job_can_be_requeued_and_asks_vitrain_to_requeue_it():
    text = SBATCH.read_text()
    assert "#SBATCH --requeue\n" in text
    assert sbatch_option("open-mode") == "append"
    assert "run.requeue=true" in text


def test_the_cluster_page_names_every_run_key_and_async_checkpoints():
    text = CLUSTER_DOC.read_text()
    keys = [f"run.{field.name}" for field in dataclasses.fields(RunConfig)] + ["train.checkpoint_async"]
    assert [key for key in keys if f"`{key}`" not in text] == []
