#!/usr/bin/env bash
# The test suite: set everything up if needed, then run every test against
# real vLLM engines, real NIXL agents and real LMCache backends.
#   scripts/test.sh          every test (tests/unit and tests/e2e; what CI runs)
#   scripts/test.sh --fast   tests/unit only: no engine, no server process
# Other arguments pass through to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
paths=()
if [[ "${1:-}" == "--fast" ]]; then
    shift
    paths=(tests/unit)
fi
# System tools only the tests use (prometheus, redis-server, fuse, docker
# compose): apt, so not part of setup.sh, which the demo also runs.
bash scripts/setup_tools.sh
bash scripts/setup.sh
.venv/bin/python -m vllm_kvbm.tools.local_model >/dev/null
# KVBM_TEST_WORKERS=2: two pytest-xdist workers, a test file each at a time: while one file's
# engine starts (mostly Python imports, one core) the other's computes.
# Default 0: one process, one test at a time (timing-sensitive tests flake under two).
workers=${KVBM_TEST_WORKERS:-0}
dist=()
[[ "$workers" == 0 ]] || dist=(-n "$workers" --dist loadfile)
exec .venv/bin/python -m pytest -p no:cacheprovider -q -rfEs --durations=25 "${dist[@]}" \
    "${paths[@]}" "$@"
