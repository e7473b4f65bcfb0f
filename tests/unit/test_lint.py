"""ruff's lint (the rules in pyproject.toml's [tool.ruff]) and its formatter's
check pass on the whole repository: undefined names, unused variables,
shadowed imports and the like fail the suite, not a reader, and so does a file
that `ruff format` would change."""

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


def ruff(*args: str, stdin: str | None = None, timeout: float = 300):
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args],
        cwd=ROOT,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_ruff_check_passes():
    need_ruff()
    out = ruff("check", "--output-format", "concise", "--no-cache", str(ROOT))
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_format_check_passes():
    """Every file as `ruff format` writes it: `.venv/bin/ruff format .` fixes a
    failure."""
    need_ruff()
    out = ruff("format", "--check", "--no-cache", str(ROOT))
    assert out.returncode == 0, (
        out.stdout + out.stderr + "\nrun `.venv/bin/ruff format .` to format these files"
    )


def test_ruff_format_reads_the_projects_settings():
    """A line the project's length (100) allows is kept whole, and a longer
    one is wrapped: the check runs with pyproject.toml's settings."""
    need_ruff()
    fits = "x = f(" + ", ".join(f"a{i}" for i in range(20)) + ")\n"
    assert 88 < len(fits) - 1 <= 100
    path = str(ROOT / "vllm_kvbm" / "x.py")
    out = ruff("format", "--check", "--stdin-filename", path, "-", stdin=fits, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    longer = "x = f(" + ", ".join(f"a{i}" for i in range(30)) + ")\n"
    out = ruff("format", "--check", "--stdin-filename", path, "-", stdin=longer, timeout=60)
    assert out.returncode == 1, out.stdout + out.stderr


def test_ruff_reads_the_projects_rules():
    """A name no module defines is reported: the rules are the project's, not
    an empty selection that passes everything."""
    need_ruff()
    out = ruff(
        "check",
        "--output-format",
        "concise",
        "--no-cache",
        "--stdin-filename",
        str(ROOT / "vllm_kvbm" / "x.py"),
        "-",
        stdin="print(undefined_name)\n",
        timeout=60,
    )
    assert out.returncode == 1 and "F821" in out.stdout, out.stdout + out.stderr
