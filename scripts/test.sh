#!/usr/bin/env bash
# The test suite: set everything up if needed, then run every test against
# real vLLM engines, real NIXL agents and real LMCache backends.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m vllm_kvbm.tools.local_model >/dev/null
exec .venv/bin/python -m pytest -p no:cacheprovider -q -rfEs --durations=10 "$@"
