#!/usr/bin/env bash
# vllm serve with KVBMConnector and a 16 GiB host tier. Usage: examples/serve.sh MODEL [vllm args]
set -euo pipefail
MODEL=${1:?usage: $0 MODEL [vllm serve args]}; shift
exec vllm serve "$MODEL" "$@" --kv-transfer-config '{"kv_connector": "KVBMConnector",
  "kv_connector_module_path": "vllm_kvbm.connector", "kv_role": "kv_both",
  "kv_connector_extra_config": {"host_cache_size": "16GiB"}}'
