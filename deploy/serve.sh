#!/usr/bin/env bash
# The Docker image's default command: vllm serve $MODEL with the KVBM connector.
# Environment: MODEL, MAX_MODEL_LEN, KVBM_HOST_CACHE_SIZE (host tier per worker),
# VLLM_CPU_KVCACHE_SPACE (engine KV cache, GiB, read by vLLM itself), and
# VLLM_EXTRA_ARGS (more `vllm serve` arguments, split on spaces). The middleware
# answers a request whose kv_transfer_params KVBM cannot honour with a 400
# naming the field (without it such a request is served without KVBM).
set -euo pipefail
: "${MODEL:?set MODEL}"
exec vllm serve "$MODEL" --host 0.0.0.0 --port "${PORT:-8000}" \
  --max-model-len "${MAX_MODEL_LEN:-4096}" \
  --kv-transfer-config "{\"kv_connector\": \"KVBMConnector\", \"kv_connector_module_path\": \"vllm_kvbm.connector\", \"kv_role\": \"kv_both\", \"kv_connector_extra_config\": {\"host_cache_size\": \"${KVBM_HOST_CACHE_SIZE:-4GiB}\"}}" \
  --middleware vllm_kvbm.serve_middleware.check_kv_transfer_params \
  ${VLLM_EXTRA_ARGS:-}
