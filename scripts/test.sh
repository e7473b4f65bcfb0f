#!/usr/bin/env bash
# The test suite: set everything up if needed, then run every test against
# real vLLM engines, real NIXL agents and real LMCache backends.
#   scripts/test.sh          every test (tests/unit and tests/e2e; what CI runs)
#   scripts/test.sh --fast   tests/unit only: no engine, no server process
# Other arguments pass through to pytest. VENV=PATH: the venv to set up (if
# needed) and test in, default .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
export VENV=${VENV:-.venv}
paths=()
if [[ "${1:-}" == "--fast" ]]; then
    shift
    paths=(tests/unit)
fi
# System tools only the tests use (prometheus, redis-server, fuse, docker
# compose): apt, so not part of setup.sh, which the demo also runs.
bash scripts/setup_tools.sh
bash scripts/setup.sh
"$VENV/bin/python" -m vllm_kvbm.tools.local_model >/dev/null
# KVBM_TEST_WORKERS (default 2, 0 on one core): pytest-xdist workers, a test file each at a time: while one
# file's engine starts (mostly Python imports, one core) the other's computes. Tests marked
# `timing` (they bound a wall-clock wait) then run alone, one at a time. 0: everything in one
# process, one test at a time.
default_workers=2
(( $(nproc) >= 2 )) || default_workers=0
workers=${KVBM_TEST_WORKERS:-$default_workers}
pytest=("$VENV/bin/python" -m pytest -p no:cacheprovider -q -rfEs --durations=25)
if [[ "$workers" == 0 ]]; then
    exec "${pytest[@]}" "${paths[@]}" "$@"
fi
# Exit code 5 is "no test selected" (a pass whose tests the arguments filtered out).
rc=0
# --no-loadscope-reorder: files go out in collection order, tests/e2e (engines, minutes a file)
# before tests/unit (seconds a file), so the unit files fill the end of the run on whichever
# worker is free. xdist's default order sends files with more tests first, which left the
# one-test e2e files (a soak, engines started inside the test) for last: a worker could end
# minutes after the other, its queue holding two or three of them.
"${pytest[@]}" -n "$workers" --dist loadfile --no-loadscope-reorder -m "not timing" \
    "${paths[@]}" "$@" || rc=$?
[[ $rc == 5 ]] && rc=0
echo "== tests that bound a wall-clock wait, alone =="
rc2=0
"${pytest[@]}" -m timing "${paths[@]}" "$@" || rc2=$?
[[ $rc2 == 5 ]] && rc2=0
exit $(( rc != 0 ? rc : rc2 ))
