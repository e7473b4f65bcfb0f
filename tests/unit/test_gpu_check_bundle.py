"""benchmarks/gpu_check.py's bundle for a CUDA machine without network
(scripts/gpu_check_prep.py, scripts/gpu_check.sh --bundle / --offline): the ELF
reader against readelf, UCX's InfiniBand modules kept unless asked, and a bundle
built from a local wheel installed and run offline on CPU."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from test_gpu_check import REPO, _import


PREP_DIR = REPO / "scripts"


def test_elf_needed_matches_readelf():
    prep = _import("gpu_check_prep", PREP_DIR)
    if shutil.which("readelf") is None:
        pytest.skip("readelf not installed")
    lib = Path(sys.executable).resolve()
    candidates = sorted(Path(os.path.dirname(os.__file__), "lib-dynload").glob("*.so"))
    lib = candidates[0] if candidates else lib
    out = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True).stdout
    want = [line.split("[")[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]
    assert prep.elf_needed(lib.read_bytes()) == want
    assert prep.elf_needed(b"not an elf file") == []


# A stand-in package that serves the installed NIXL's modules (its own dir first on
# __path__, then the real one's): the check runs for real from the bundle's install.
FORWARD = """
import importlib.machinery, os, sys
_mine = os.path.dirname(os.path.dirname(__file__))
_real = importlib.machinery.PathFinder.find_spec(
    __name__, [p for p in sys.path if os.path.abspath(p) != _mine])
__path__.extend(_real.submodule_search_locations)
"""


def fake_wheel(path: Path, package: str = "nixl_cu12", forward: bool = False) -> Path:
    """A wheel laid out as NIXL's: the package, its libs with UCX's modules."""
    libs = f"{package}.libs/ucx"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{package}/__init__.py", FORWARD if forward else "")
        if not forward:
            zf.writestr(f"{package}/_api.py", "")
        zf.writestr(
            f"{package}-1.5.1.dist-info/METADATA",
            f"Metadata-Version: 2.1\nName: {package.replace('_', '-')}\nVersion: 1.5.1\n",
        )
        zf.writestr(
            f"{package}-1.5.1.dist-info/WHEEL",
            "Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: cp311-cp311-any\n",
        )
        for mod in (
            "libuct_cma",
            "libuct_cuda",
            "libuct_ib",
            "libuct_ib_mlx5",
            "libuct_rdmacm",
            "libucx_perftest_cuda",
        ):
            zf.writestr(f"{libs}/{mod}.so.0", b"not an elf file")
        zf.writestr(f"{package}-1.5.1.dist-info/RECORD", "")
    return path


def test_strip_keeps_ucx_infiniband_unless_asked(tmp_path):
    prep = _import("gpu_check_prep", PREP_DIR)
    with zipfile.ZipFile(fake_wheel(tmp_path / "w.whl")) as zf:
        kept = {Path(n).name for n in prep.keep_set(zf)}
        no_ib = {Path(n).name for n in prep.keep_set(zf, ib=False)}
    ib = {"libuct_ib.so.0", "libuct_ib_mlx5.so.0", "libuct_rdmacm.so.0"}
    assert ib <= kept and "libuct_cma.so.0" in kept and "libuct_cuda.so.0" in kept
    assert not ib & no_ib and "libuct_cma.so.0" in no_ib
    assert "libucx_perftest_cuda.so.0" not in kept


def test_bundle_then_offline_run(tmp_path):
    """--bundle DIR gathers the NIXL wheel (here from KVBM_GPU_CHECK_WHEELS, not
    the network) and the repository's committed files into DIR and DIR.tar.gz;
    --offline DIR installs the wheel without network and runs the check from DIR."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    pyver = f"{sys.version_info[0]}{sys.version_info[1]}"
    fake_wheel(
        wheels / f"nixl_cu12-1.5.1-cp{pyver}-cp{pyver}-manylinux_2_28_x86_64.whl", forward=True
    )
    env = {**os.environ, "PYTHON": sys.executable, "KVBM_GPU_CHECK_WHEELS": str(wheels)}
    out = tmp_path / "kvbm-gpu-check"
    made = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), "--bundle", str(out), "--cuda", "12"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert made.returncode == 0, made.stdout + made.stderr
    assert (out / "src" / "benchmarks" / "gpu_check.py").exists()
    assert (tmp_path / "kvbm-gpu-check.tar.gz").exists()
    assert [p.name for p in (out / "wheels").iterdir()] == [
        f"nixl_cu12-1.5.1-cp{pyver}-cp{pyver}-manylinux_2_28_x86_64.whl"
    ]
    log = tmp_path / "log"
    ran = subprocess.run(
        [
            "bash",
            str(out / "src" / "scripts" / "gpu_check.sh"),
            "--offline",
            str(out),
            "--device",
            "cpu",
            "--cases",
            "gds",
            "--gds-mib",
            "4",
            "--repeats",
            "1",
        ],
        capture_output=True,
        text=True,
        env={**env, "KVBM_GPU_CHECK_LOG": str(log)},
        cwd=tmp_path,
        timeout=600,
    )
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert (out / "site" / "nixl_cu12" / "__init__.py").exists()  # installed from the bundle
    assert "gpu_check: all " in log.read_text() and "NIXL POSIX file -> host" in ran.stdout
