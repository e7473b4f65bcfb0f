"""The scheduler-side tests on the newest release of every other supported vLLM
series: each release's pure-Python sources fetched from PyPI (cached) and a
nested pytest run over them. e2e: it runs test_hit_sources (an LMCache server)
and takes minutes; tests/unit/test_vllm_compat.py checks the base classes."""

from __future__ import annotations

import os
import sys

import pytest

from helpers import ROOT
from vllm_kvbm.config import SUPPORTED_VLLM
from vllm_kvbm.tools import vllm_wheels as wheels


# The connector's scheduler-side tests, which need vLLM's Scheduler but no
# compiled vLLM code: they also run on the other supported releases.
SCHEDULER_TESTS = [
    "tests/e2e/test_hit_sources.py",
    "tests/unit/test_scheduler_unit.py",
    "tests/unit/test_scheduler_store_load.py",
    "tests/unit/test_scheduler_free_and_preempt.py",
    "tests/unit/test_keys.py",
    "tests/unit/test_tier_policy.py",
]


@pytest.mark.parametrize("series", SUPPORTED_VLLM.series())
def test_scheduler_tests_pass_on_the_newest_release_of(series):
    """vLLM's real Scheduler of that release (its pure-Python sources, first on
    PYTHONPATH, over the installed torch) runs SCHEDULER_TESTS."""
    import subprocess

    import vllm

    if vllm.__version__.startswith(series + "."):
        pytest.skip(f"vLLM {vllm.__version__} is installed: the suite itself runs on it")
    try:
        index, _ = wheels.fetch_index()
        [*_, release] = [
            r for r in wheels.list_releases(index) if r.version.startswith(series + ".")
        ] or [None]
        assert release is not None, f"no vLLM {series}.x on PyPI"
        sources = wheels.python_sources(release)
    except wheels.Offline as err:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run on every supported vLLM release, but: {err}")
        pytest.skip(f"no network and nothing cached: {err}")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(sources), os.environ.get("PYTHONPATH")) if p),
    }
    seen = subprocess.run(
        [sys.executable, "-c", "import vllm; print(vllm.__version__)"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert seen.stdout.strip() == release.version, seen.stderr[-2000:]
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-W",
            "ignore",
            *SCHEDULER_TESTS,
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert run.returncode == 0, f"on vLLM {release.version}:\n{run.stdout[-6000:]}"
