#!/usr/bin/env bash
# The main job: set everything up if needed, then serve the local model with
# KVBMConnector and show a returning long prompt onboarded from the host tier.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m vllm_kvbm.tools.demo "$@"
