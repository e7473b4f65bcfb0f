"""``KVBM_*`` variables that are not settings, and the warning for a misspelt one.

A misspelt key in ``kv_connector_extra_config`` stops startup with a
suggestion; a misspelt variable (``KVBM_HOST_CACHE_SIZ``) would be silently
ignored, so load_config warns about every ``KVBM_*`` name it neither reads
nor finds here, naming the closest it reads. Names only: a value may be a
secret.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping

# Read by KVBM's scripts, images, tools and tests, not by the connector.
OTHER_KVBM_ENV = frozenset(
    {
        "KVBM_BIND_ADDR",  # docker-compose.yml: the address ports are published on
        "KVBM_CACHE_DIR",  # Dockerfile, compose, tools/vllm_wheels.py: downloads
        "KVBM_CI_VENV",  # .ci/run
        "KVBM_CONSTRAINTS",  # scripts/setup.sh: the lock file
        "KVBM_DTYPE",  # tools/compute_dtype.py: the demo's and tests' dtype
        "KVBM_ENV_FILE",  # scripts/compose_secrets.sh
        "KVBM_GPU_CHECK_LOG",  # scripts/gpu_check.sh
        "KVBM_GPU_CHECK_NIXL",
        "KVBM_GPU_CHECK_WHEELS",
        "KVBM_IDENTITY_PROBE_DIR",  # tests
        "KVBM_POOL_SHM_SIZE",  # docker-compose.yml
        "KVBM_SECRETS_DIR",  # scripts/compose_secrets.sh
        "KVBM_SETUP_TOOLS",  # scripts/setup.sh
        "KVBM_SMOKE_LOCK",  # scripts/wheel_smoke.sh
        "KVBM_TEST_MODEL",  # tests
        "KVBM_TEST_WORKERS",  # scripts/test.sh
        "KVBM_TORCH_INDEX",  # scripts/setup.sh
    }
)


def misspelt_env(environ: Mapping[str, str], read: Iterable[str]) -> list[str]:
    """One line per ``KVBM_*`` name in ``environ`` that is neither in
    ``read`` (the variables load_config reads) nor a script's, with the
    closest name it reads where one is close."""
    read = set(read)
    lines = []
    for name in sorted(environ):
        if not name.startswith("KVBM_") or name in read or name in OTHER_KVBM_ENV:
            continue
        hint = difflib.get_close_matches(name, sorted(read), n=1, cutoff=0.8)
        lines.append(
            f"{name} is not a KVBM variable and is ignored"
            + (f"; did you mean {hint[0]}?" if hint else " (docs/configuration.md lists them)")
        )
    return lines
