#!/usr/bin/env bash
# KVBM's GPU check (benchmarks/gpu_check.py) on a machine with an NVIDIA GPU.
#
# Needs CUDA PyTorch, vLLM and vllm_kvbm with NIXL installed (in a clone:
# pip install -e ".[cuda]"; a release: docs/quickstart-gpu.md#install). From the repository:
#
#   bash scripts/gpu_check.sh [gpu_check.py options]       # about four minutes
#
# A GPU machine without network: bundle NIXL and the check on a machine with network, copy
# the bundle over, run it there:
#
#   bash scripts/gpu_check.sh --bundle DIR [--python 3.12] [--cuda 12] [--slim]
#       # DIR/wheels: NIXL's wheel for that Python and CUDA major (default: this machine's);
#       # DIR/src: this repository's committed files; and DIR.tar.gz of both.
#       # --slim keeps only what the check loads (UCX's InfiniBand modules included).
#   bash DIR/src/scripts/gpu_check.sh --offline DIR [gpu_check.py options]
#       # installs DIR/wheels into DIR/site (no network) and runs the check from DIR/src
#
# Its vllm case starts an offline vLLM engine with KVBM (a small random-weight model built into
# models/ without network, or --vllm-model PATH); without vLLM installed it is skipped.
# Its last case, peer-read, starts a kvbm-pool process (a free local port, its pool file in
# /dev/shm or the temp dir) and reads its pages into pinned memory; it needs pyzmq (vLLM's).
# It prints one row per check as it runs (case, check, PASS/FAIL/info, detail), then
# "gpu_check: all N checks passed" or "N of M checks FAILED"; the exit status is 0 only when
# every check passed. KVBM_GPU_CHECK_LOG=FILE keeps a copy of the output. PYTHON picks the
# interpreter (default python3); KVBM_GPU_CHECK_WHEELS=DIR bundles the wheels found there
# instead of downloading them.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python3}"
NIXL_VERSION="${KVBM_GPU_CHECK_NIXL:-1.5.1}"

run_check() {  # src_dir [gpu_check.py args]
    local src="$1"; shift
    # cuFile and the CUDA libraries NIXL's GDS plugin loads: the nvidia-* wheels beside PyTorch
    local libs
    libs="$("$PY" -c 'import glob, os, sys
found = [glob.glob(os.path.join(b, "nvidia", "*", "lib", "lib*.so*")) for b in sys.path]
print(":".join(sorted({os.path.dirname(p) for f in found for p in f})))')"
    export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export PYTHONUNBUFFERED=1
    if [ -n "${KVBM_GPU_CHECK_LOG:-}" ]; then
        set +e
        "$PY" "$src/benchmarks/gpu_check.py" "$@" 2>&1 | tee "$KVBM_GPU_CHECK_LOG"
        local status=${PIPESTATUS[0]}
        set -e
        return "$status"
    fi
    "$PY" "$src/benchmarks/gpu_check.py" "$@"
}

bundle() {  # DIR [--python X.Y] [--cuda N] [--slim]
    local dir="$1"; shift
    local pyver cuda slim=0
    pyver="$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
    cuda="$("$PY" -c 'import torch; print((torch.version.cuda or "12").split(".")[0])' \
        2>/dev/null || echo 12)"
    while [ $# -gt 0 ]; do
        case "$1" in
            --python) pyver="$2"; shift 2 ;;
            --cuda) cuda="$2"; shift 2 ;;
            --slim) slim=1; shift ;;
            *) echo "gpu_check.sh: unknown --bundle option $1" >&2; exit 2 ;;
        esac
    done
    mkdir -p "$dir/wheels" "$dir/src"
    local tag="cp${pyver/./}"
    local wheel_glob="nixl_cu${cuda}-${NIXL_VERSION}-${tag}-*.whl"
    if [ -n "${KVBM_GPU_CHECK_WHEELS:-}" ]; then
        cp "$KVBM_GPU_CHECK_WHEELS"/$wheel_glob "$dir/wheels/"
    else
        "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
            --implementation cp --platform manylinux_2_28_x86_64 \
            --platform manylinux_2_17_x86_64 -d "$dir/wheels" "nixl-cu${cuda}==$NIXL_VERSION"
    fi
    if [ "$slim" = 1 ]; then
        for w in "$dir"/wheels/$wheel_glob; do
            "$PY" "$ROOT/scripts/gpu_check_prep.py" strip "$w" "$w.slim" && mv "$w.slim" "$w"
        done
    fi
    git -C "$ROOT" archive --format=tar HEAD | tar -x -C "$dir/src"
    tar -czf "$dir.tar.gz" -C "$(dirname "$dir")" "$(basename "$dir")"
    echo "gpu_check.sh: bundle in $dir and $dir.tar.gz ($(du -sh "$dir" | cut -f1)):"
    ls "$dir/wheels"
    echo "On the GPU machine: tar -xzf $(basename "$dir").tar.gz &&" \
         "bash $(basename "$dir")/src/scripts/gpu_check.sh --offline $(basename "$dir")"
}

case "${1:-}" in
    --bundle)
        [ $# -ge 2 ] || { echo "usage: gpu_check.sh --bundle DIR [options]" >&2; exit 2; }
        shift; bundle "$@" ;;
    --offline)
        [ $# -ge 2 ] || { echo "usage: gpu_check.sh --offline DIR [options]" >&2; exit 2; }
        dir="$(cd "$2" && pwd)"; shift 2
        "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade \
            --target "$dir/site" "$dir"/wheels/*.whl
        export PYTHONPATH="$dir/site${PYTHONPATH:+:$PYTHONPATH}"
        run_check "$dir/src" "$@" ;;
    *)
        run_check "$ROOT" "$@" ;;
esac
