"""A misspelt KVBM_* variable is warned about with the name it was probably
meant to be (a misspelt extra-config key stops startup; a variable was
silently ignored), the values never shown; every KVBM_* name the repository's
scripts, images and docs use is either read by the connector or known as a
script's, so none of them warns."""

from __future__ import annotations

import logging
import re
import subprocess
from pathlib import Path

from vllm_kvbm.config import _ENV, load_config
from vllm_kvbm.config.env_names import OTHER_KVBM_ENV, misspelt_env

ROOT = Path(__file__).resolve().parents[2]
SECRETS = ("KVBM_REMOTE_PASSWORD", "KVBM_PAGE_SECRET")
# KVBM_* words in the repository that are not environment variables
NOT_ENV = {
    "KVBM_CONFIG",  # examples/lmbenchmark/run.sh: a shell variable
    "KVBM_HOST_CACHE_SIZ",
}  # configuration.md: the warning's example


def warnings_of(environ: dict, caplog) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vllm_kvbm.config"):
        load_config({}, environ=environ)
    return [r.getMessage() for r in caplog.records]


def test_a_misspelt_variable_is_warned_with_the_name_meant(caplog):
    got = warnings_of(
        {"KVBM_HOST_CACHE_SIZ": "secret-looking-16GiB", "KVBM_REMOTE_PASWORD": "hunter2hunter2"},
        caplog,
    )
    assert (
        "KVBM: KVBM_HOST_CACHE_SIZ is not a KVBM variable and is ignored; did you mean "
        "KVBM_HOST_CACHE_SIZE?"
    ) in got, got
    assert any(
        "KVBM_REMOTE_PASWORD" in m and "did you mean KVBM_REMOTE_PASSWORD?" in m for m in got
    ), got
    assert not any("hunter2" in m or "secret-looking" in m for m in got), got
    got = warnings_of({"KVBM_FROBNICATE": "1"}, caplog)
    assert got == [
        "KVBM: KVBM_FROBNICATE is not a KVBM variable and is ignored "
        "(docs/configuration.md lists them)"
    ], got


def test_variables_read_or_used_by_scripts_do_not_warn(caplog):
    environ = {name: "x" for name in OTHER_KVBM_ENV}
    environ.update(
        {
            "KVBM_HOST_CACHE_SIZE": "1GiB",
            "KVBM_NAMESPACE": "a",
            "PATH": "/bin",
            "DYN_KVBM_CPU_CACHE_GB": "1",
        }
    )
    environ.pop("KVBM_HOST_CACHE_SIZE")
    assert warnings_of(environ, caplog) == []


def test_every_kvbm_variable_the_repository_names_is_known():
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    named: set[str] = set()
    for f in files:
        path = ROOT / f
        if path == Path(__file__).resolve():
            continue  # this file's misspellings on purpose
        if path.suffix in (".png", ".whl", ".gz") or not path.is_file():
            continue
        try:
            named.update(re.findall(r"\bKVBM_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
        except UnicodeDecodeError:
            continue
    assert len(named) > 40, sorted(named)
    environ = {name: "x" for name in named - NOT_ENV}
    unknown = misspelt_env(environ, [*_ENV, *SECRETS])
    assert unknown == [], unknown
