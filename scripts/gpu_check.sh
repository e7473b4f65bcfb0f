#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py) on a CUDA machine without network,
# such as the device machine a session may be lent (CPython 3.12, PyTorch
# for CUDA 13, no vLLM, no NIXL, at most 64 MiB of working tree carried).
#
#   bash scripts/gpu_check.sh            # here: fetch + strip the NIXL wheel into .whl/,
#                                        # print the carried size and the device call
#   bash scripts/gpu_check.sh --dry-run  # the same without downloading (.whl/ must hold it)
#   bash scripts/gpu_check.sh --on-device [gpu_check.py args]
#                                        # there: install .whl/ into /tmp/site and run the
#                                        # check, log to $OUT/log (under five minutes)
set -euo pipefail
cd "$(dirname "$0")/.."

NIXL_VERSION="${KVBM_GPU_CHECK_NIXL:-1.5.1}"
WHEEL="nixl_cu13-${NIXL_VERSION}-cp312-cp312-manylinux_2_28_x86_64.whl"
CACHE="${KVBM_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm_kvbm/gpu-check}"
CHECK_TIMEOUT_S=280  # gpu_check.py's limit on the device: the run tool allows 600 s a call

on_device() {
    set -x
    nvidia-smi -L || true
    ls -l /dev/nvidia-fs* 2>/dev/null || echo "no /dev/nvidia-fs* (no GDS kernel driver)"
    df -hT . /tmp | cat
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
    # cuFile and the CUDA runtime for NIXL's GDS plugin (the nvidia-* wheels beside PyTorch)
    libs="$(python3 -c 'import glob, os, sys
libs = [glob.glob(os.path.join(b, "nvidia", "*", "lib", "lib*.so*")) for b in sys.path]
print(":".join(sorted({os.path.dirname(p) for found in libs for p in found})))')"
    export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    set +x
    timeout "$CHECK_TIMEOUT_S" python3 benchmarks/gpu_check.py --gds-dir . "$@"
}

if [ "${1:-}" = "--on-device" ]; then
    shift
    OUT="${OUT:-/tmp/gpu-check-out}"
    mkdir -p "$OUT"
    set +e
    on_device "$@" 2>&1 | tee "$OUT/log"
    status=${PIPESTATUS[0]}
    echo "gpu_check.sh: exit status $status" | tee -a "$OUT/log"
    exit "$status"
fi

dry=0
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
PY="python3"
[ -x .venv/bin/python ] && PY=.venv/bin/python

# .whl/ travels only as a carried path: git must ignore it
if ! grep -qx '/.whl/' .git/info/exclude 2>/dev/null; then
    mkdir -p .git/info
    echo '/.whl/' >> .git/info/exclude
fi
mkdir -p .whl

if [ ! -f ".whl/$WHEEL" ]; then
    if [ "$dry" = 1 ]; then
        echo "gpu_check.sh: .whl/$WHEEL is missing; run without --dry-run to fetch it" >&2
        exit 1
    fi
    mkdir -p "$CACHE"
    if [ ! -f "$CACHE/$WHEEL" ]; then
        "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            -d "$CACHE" "nixl-cu13==$NIXL_VERSION"
    fi
    rm -f .whl/nixl_cu13-*.whl  # one version only: two stop the install
    python3 scripts/gpu_check_prep.py strip "$CACHE/$WHEEL" ".whl/$WHEEL"
fi

python3 scripts/gpu_check_prep.py size --carry .whl
cat <<EOF
On a session lent a CUDA machine, one device call (about 3-5 minutes with the machine's start):
  run(command="bash scripts/gpu_check.sh --on-device", carry=[".whl"], timeout_s=420)
It installs .whl/ into /tmp/site, runs benchmarks/gpu_check.py (limit ${CHECK_TIMEOUT_S} s) and
leaves its output in \$OUT/log; give_back afterwards unless rerunning at once.
EOF
