"""The code base stays ruff-clean (lint and format), so CI's single test command also checks style."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.conftest import REPO


@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]])
def test_ruff_is_clean(command):
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed; it comes with the dev extra: pip install -e '.[dev]'")
    result = subprocess.run([ruff, *command], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
