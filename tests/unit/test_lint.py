"""ruff's lint (the rules in pyproject.toml's [tool.ruff]) passes on the whole
repository: undefined names, unused variables, shadowed imports and the like
fail the suite, not a reader."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def need_ruff() -> None:
    """Skipped without ruff, except under CI (.ci/run builds the venv with it)."""
    if importlib.util.find_spec("ruff") is None:
        if os.environ.get("CI"):
            pytest.fail("ruff is not installed: scripts/setup.sh installs it (the test extra)")
        pytest.skip("ruff is installed by scripts/setup.sh (the test extra)")


def test_ruff_check_passes():
    need_ruff()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "check",
            "--output-format",
            "concise",
            "--no-cache",
            str(ROOT),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_reads_the_projects_rules():
    """A name no module defines is reported: the rules are the project's, not
    an empty selection that passes everything."""
    need_ruff()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "check",
            "--output-format",
            "concise",
            "--no-cache",
            "--stdin-filename",
            str(ROOT / "vllm_kvbm" / "x.py"),
            "-",
        ],
        cwd=ROOT,
        input="print(undefined_name)\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "F821" in out.stdout, out.stdout + out.stderr
