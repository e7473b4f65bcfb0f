"""docker-compose.yml rendered by `docker compose config` (no Docker engine
needed), with .env.example's values: what tests/unit/test_compose*.py read.
An operator's .env is never read.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from dotenv import dotenv_values

from helpers import ROOT

COMPOSE_PLUGIN = Path("/usr/local/lib/docker/cli-plugins/docker-compose")


def dotenv() -> dict[str, str | None]:
    """.env.example's values as written (no ``${VAR}`` filled from this environment)."""
    return dict(dotenv_values(ROOT / ".env.example", interpolate=False))


def compose_command() -> list[str]:
    for cmd in (["docker", "compose"], [str(COMPOSE_PLUGIN)], ["docker-compose"]):
        if shutil.which(cmd[0]) is None:
            continue
        probe = subprocess.run([*cmd, "version"], capture_output=True, text=True)
        if probe.returncode == 0 and "v2." in probe.stdout:
            return cmd
    pytest.fail(
        "Docker Compose v2 is not installed: run scripts/setup.sh "
        "(it installs the docker compose CLI plugin)"
    )


# What an operator puts in .env besides .env.example's values (they have no
# default): a Grafana password, and the secret files scripts/compose_secrets.sh
# writes and names.
GRAFANA_PASSWORD = "a-password-for-the-test"
SECRET_FILES = {
    "REDIS_PASSWORD_FILE": "./secrets/redis_password",
    "PAGE_SECRET_FILE": "./secrets/kvbm_page_secret",
}


def render(*args: str, **env) -> subprocess.CompletedProcess:
    """`docker compose [ARGS] config` of the repo's compose file with
    .env.example's values, the variables ENV over them."""
    clean = {
        k: v for k, v in os.environ.items() if k not in dotenv() and not k.startswith("COMPOSE_")
    }
    return subprocess.run(
        [*compose_command(), "--env-file", ".env.example", *args, "config", "--format", "json"],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def resolved(*args: str, **env) -> dict:
    """The resolved compose file as JSON, with a Grafana password and the
    secret files set."""
    proc = render(*args, **{"GRAFANA_ADMIN_PASSWORD": GRAFANA_PASSWORD, **SECRET_FILES, **env})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)
