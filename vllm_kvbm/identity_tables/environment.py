"""The reviewed ``VLLM_*`` environment variables that cannot change the KV
bytes vLLM computes for a prefix.

Every other ``VLLM_*`` variable that is set counts as identity: its name and
value join the key namespace (identity_fields.identity_env), so engines that
differ in it never share pages. vLLM reads over 300 of them and a release adds
more; one not reviewed may select a kernel, a precision or a routing
(``VLLM_FLOAT32_MATMUL_PRECISION``, ``VLLM_MOE_ROUTING_SIMULATION_STRATEGY``),
so the default is identity, and this table lists only what is known to be
harmless, with the reason.

Variables that differ between replicas computing the same KV (ports,
addresses, ranks, ids) or that vLLM sets in some of one engine's processes
only (``VLLM_DIST_IDENT``, set by its CPU worker) MUST be here: otherwise
replicas would never share, or an engine's scheduler and workers would name
pages differently (tests/e2e/test_identity_fields_e2e.py compares them).
Unset variables are the same default on every side and are not hashed.
"""

from __future__ import annotations

PORT = "a network address, port or id: differs between replicas"
LOG = "logging, metrics, tracing or profiling only"
BUILD = "read when vLLM is built or packaged, not when it runs"
PATH = "where caches, assets or logs are kept; what they hold is not KV"
API = (
    "acts on the API server's requests and responses (text, tools, limits): "
    "the token ids, which are in the key, are what the KV follows"
)
MEDIA = (
    "how multimodal inputs are fetched or limited, not what they encode to "
    "(a refused input has no KV)"
)
TIMEOUT = "a timeout or a retry"
PROCESSES = "how vLLM's processes start and talk to each other, not what they compute"
PLACEMENT = "which cores, memory or devices run the work, not what it computes"
DP = "data parallel replicas of one model compute the same KV"
SAMPLING = "acts on logits or sampled tokens, after the KV"
OFFLOAD = "vLLM's own KV offloading or KV transfer, not the KV computed"
STREAMS = "overlaps work on other streams; the same kernels compute the same values"
GRAPHS = (
    "CUDA graphs replay the kernels a batch would run eagerly (the config "
    "table's reason for cudagraph settings)"
)
WEIGHTS_IO = "how weight files are read or where weights wait, not which weights run"

HARMLESS_ENV: dict[str, str] = {
    # addresses, ports, ids
    "VLLM_PORT": PORT,
    "VLLM_HOST_IP": PORT,
    "VLLM_LOOPBACK_IP": PORT,
    "VLLM_RPC_BASE_PATH": PORT,
    "VLLM_DP_MASTER_IP": PORT,
    "VLLM_DP_MASTER_PORT": PORT,
    "VLLM_NIXL_SIDE_CHANNEL_HOST": PORT,
    "VLLM_NIXL_SIDE_CHANNEL_PORT": PORT,
    "VLLM_P2P_SIDE_CHANNEL_HOST": PORT,
    "VLLM_P2P_SIDE_CHANNEL_PORT": PORT,
    "VLLM_EC_SIDE_CHANNEL_HOST": PORT,
    "VLLM_EC_SIDE_CHANNEL_PORT": PORT,
    "VLLM_MOONCAKE_BOOTSTRAP_PORT": PORT,
    "VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME": PORT,
    "VLLM_DIST_IDENT": PORT + "; set by vLLM's CPU worker in the worker processes only",
    # data parallelism
    "VLLM_DP_RANK": DP,
    "VLLM_DP_RANK_LOCAL": DP,
    "VLLM_DP_SIZE": DP,
    "VLLM_RANDOMIZE_DP_DUMMY_INPUTS": DP + " (dummy batches of idle replicas)",
    "VLLM_RAY_DP_PACK_STRATEGY": DP,
    "VLLM_RAY_DP_PLACEMENT_NODE_IPS": DP,
    # logging, metrics, profiling, usage reports
    "VLLM_CONFIGURE_LOGGING": LOG,
    "VLLM_LOGGING_COLOR": LOG,
    "VLLM_LOGGING_CONFIG_PATH": LOG,
    "VLLM_LOGGING_LEVEL": LOG,
    "VLLM_LOGGING_PREFIX": LOG,
    "VLLM_LOGGING_STREAM": LOG,
    "VLLM_LOG_BATCHSIZE_INTERVAL": LOG,
    "VLLM_LOG_MODEL_INSPECTION": LOG,
    "VLLM_LOG_STATS_INTERVAL": LOG,
    "VLLM_DISABLE_LOG_LOGO": LOG,
    "VLLM_DEBUG_LOG_API_SERVER_RESPONSE": LOG,
    "VLLM_DEBUG_MFU_METRICS": LOG,
    "VLLM_DEBUG_DUMP_PATH": LOG,
    "VLLM_RINGBUFFER_WARNING_INTERVAL": LOG,
    "VLLM_MOONCAKE_STORE_TIER_LOG": LOG,
    "VLLM_PROCESS_NAME_PREFIX": LOG,
    "VLLM_GC_DEBUG": LOG,
    "VLLM_TRACE_FUNCTION": LOG,
    "VLLM_CUSTOM_SCOPES_FOR_PROFILING": LOG,
    "VLLM_NVTX_SCOPES_FOR_PROFILING": LOG,
    "VLLM_DO_NOT_TRACK": LOG,
    "VLLM_NO_USAGE_STATS": LOG,
    "VLLM_USAGE_SOURCE": LOG,
    "VLLM_USAGE_STATS_SERVER": LOG,
    "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": LOG + " (the format of published KV events)",
    # building and packaging
    "VLLM_BUILD_COMMIT": BUILD,
    "VLLM_BUILD_PIPELINE": BUILD,
    "VLLM_BUILD_URL": BUILD,
    "VLLM_DOCKER_BUILD_CONTEXT": BUILD,
    "VLLM_IMAGE_TAG": BUILD,
    "VLLM_MAIN_CUDA_VERSION": BUILD,
    "VLLM_NCCL_INCLUDE_PATH": BUILD,
    "VLLM_SKIP_PRECOMPILED_VERSION_SUFFIX": BUILD,
    "VLLM_SKIP_VERSION_SUFFIX": BUILD,
    "VLLM_USE_PRECOMPILED": BUILD,
    "VLLM_USE_PRECOMPILED_RUST": BUILD,
    "VLLM_PRECOMPILED_WHEEL_LOCATION": BUILD,
    # paths of caches and assets
    "VLLM_ASSETS_CACHE": PATH,
    "VLLM_ASSETS_CACHE_MODEL_CLEAN": PATH,
    "VLLM_CACHE_ROOT": PATH,
    "VLLM_CONFIG_ROOT": PATH,
    "VLLM_LORA_RESOLVER_CACHE_DIR": PATH,
    "VLLM_XLA_CACHE_PATH": PATH,
    # the API server
    "VLLM_API_KEY": API + "; a credential, never hashed",
    "VLLM_ENABLE_COHERE_API": API,
    "VLLM_ENABLE_RESPONSES_API_STORE": API,
    "VLLM_ENFORCE_STRICT_TOOL_CALLING": API,
    "VLLM_TOOL_JSON_ERROR_AUTOMATIC_RETRY": API,
    "VLLM_TOOL_PARSE_REGEX_TIMEOUT_SECONDS": API,
    "VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT": API,
    "VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS": API,
    "VLLM_GPT_OSS_SYSTEM_TOOL_MCP_LABELS": API,
    "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": API,
    "VLLM_MAX_COMPLETION_PROMPTS": API,
    "VLLM_MAX_N_SEQUENCES": API,
    "VLLM_MAX_STOP_STRINGS": API,
    "VLLM_MAX_BAD_WORDS_TOTAL_TOKENS": API,
    "VLLM_MAX_NUM_BAD_WORDS": API,
    "VLLM_SERVER_DEV_MODE": API,
    "VLLM_SKIP_MODEL_NAME_VALIDATION": API,
    "VLLM_USE_RUST_FRONTEND": API,
    "VLLM_RUST_FRONTEND_PATH": API,
    "VLLM_USE_RUST_BENCH": API,
    "VLLM_USE_EXPERIMENTAL_PARSER_CONTEXT": API,
    "VLLM_USE_FASTOKENS": API + " (the tokenizer's implementation)",
    "VLLM_V1_OUTPUT_PROC_CHUNK_SIZE": API,
    "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION": API,
    "VLLM_REGEX_COMPILATION_TIMEOUT_S": API,
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN": API + "; max_model_len itself is identity",
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": API + "; each adapter's files are in its keys",
    "VLLM_LORA_RESOLVER_HF_REPO_LIST": API + "; each adapter's files are in its keys",
    "VLLM_SYSTEM_START_DATE": API + " (a date written into a system prompt's text)",
    "VLLM_USE_MODELSCOPE": "where weights are downloaded from; their content is hashed",
    # multimodal input fetching
    "VLLM_AUDIO_FETCH_TIMEOUT": MEDIA,
    "VLLM_IMAGE_FETCH_TIMEOUT": MEDIA,
    "VLLM_VIDEO_FETCH_TIMEOUT": MEDIA,
    "VLLM_MEDIA_CACHE": MEDIA,
    "VLLM_MEDIA_CACHE_MAX_SIZE_MB": MEDIA,
    "VLLM_MEDIA_CACHE_TTL_HOURS": MEDIA,
    "VLLM_MEDIA_CONNECTOR": MEDIA,
    "VLLM_MEDIA_FETCH_MAX_RETRIES": MEDIA,
    "VLLM_MEDIA_LOADING_THREAD_COUNT": MEDIA,
    "VLLM_MEDIA_URL_ALLOW_REDIRECTS": MEDIA,
    "VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB": MEDIA,
    "VLLM_MAX_AUDIO_CLIP_FILESIZE_MB": MEDIA,
    "VLLM_MAX_AUDIO_DECODE_BYTES": MEDIA,
    "VLLM_MAX_AUDIO_DECODE_DURATION_S": MEDIA,
    "VLLM_MAX_AUDIO_PREPROCESS_WORKERS": MEDIA,
    "VLLM_MAX_EMBED_DECODE_BYTES": MEDIA,
    "VLLM_MAX_IMAGE_PIXELS": MEDIA,
    # processes, timeouts, serialization
    "VLLM_ENABLE_V1_MULTIPROCESSING": PROCESSES,
    "VLLM_WORKER_MULTIPROC_METHOD": PROCESSES + "; set by vLLM's CPU platform",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": PROCESSES,
    "VLLM_MSGPACK_ZERO_COPY_THRESHOLD": PROCESSES,
    "VLLM_MQ_MAX_CHUNK_BYTES_MB": PROCESSES,
    "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": PROCESSES,
    "VLLM_ELASTIC_EP_DRAIN_REQUESTS": PROCESSES,
    "VLLM_ELASTIC_EP_SCALE_UP_LAUNCH": PROCESSES,
    "VLLM_RAY_BUNDLE_INDICES": PROCESSES,
    "VLLM_RAY_PER_WORKER_GPUS": PROCESSES,
    "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY": PROCESSES,
    "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY": PROCESSES,
    "VLLM_USE_RAY_COMPILED_DAG_CHANNEL_TYPE": PROCESSES + "; set by vLLM's Ray executor",
    "VLLM_ENGINE_READY_TIMEOUT_S": TIMEOUT,
    "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": TIMEOUT,
    "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": TIMEOUT,
    "VLLM_SNAPSHOT_TIMEOUT_S": TIMEOUT,
    "VLLM_P2P_HANDSHAKE_TIMEOUT_S": TIMEOUT,
    "VLLM_P2P_IDLE_TIMEOUT_S": TIMEOUT,
    "VLLM_P2P_MAX_PEERS": PROCESSES,
    "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT": TIMEOUT,
    "VLLM_MOONCAKE_CONNECTOR_TIMEOUT": TIMEOUT,
    "VLLM_MORIIO_TRANSFER_TIMEOUT_S": TIMEOUT,
    # where work runs
    "VLLM_CPU_OMP_THREADS_BIND": PLACEMENT,
    "VLLM_CPU_NUM_OF_RESERVED_CPU": PLACEMENT,
    "VLLM_CPU_KVCACHE_SPACE": PLACEMENT + " (how much KV fits)",
    "VLLM_CPU_SIM_MULTI_NUMA": PLACEMENT,
    "VLLM_TRITON_JIT_WARMUP_NUM_THREADS": PLACEMENT,
    "VLLM_WSL2_ENABLE_PIN_MEMORY": PLACEMENT,
    "VLLM_GPU_NIC_PCIE_MAPPING": PLACEMENT,
    "VLLM_NIC_SELECTION_VARS": PLACEMENT,
    "VLLM_ROCM_SLEEP_MEM_CHUNK_SIZE": PLACEMENT,
    "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS": PLACEMENT + " (how much KV fits)",
    "VLLM_ENABLE_CUDAGRAPH_GC": PLACEMENT + " (garbage collection while graphs are captured)",
    "VLLM_DEEP_GEMM_WARMUP": "which kernels are compiled ahead of use",
    "VLLM_DISABLE_SHARED_EXPERTS_STREAM": STREAMS + "; set by vLLM's CPU platform",
    "VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD": STREAMS,
    "VLLM_USE_BREAKABLE_CUDAGRAPH": GRAPHS + "; set by vLLM's config for some models",
    # weight files and weight memory
    "VLLM_FASTSAFETENSORS_QUEUE_SIZE": WEIGHTS_IO,
    "VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY": WEIGHTS_IO,
    "VLLM_WEIGHT_OFFLOADING_DISABLE_UVA": WEIGHTS_IO,
    # after the KV, or beside it
    "VLLM_USE_FLASHINFER_SAMPLER": SAMPLING,
    "VLLM_COMPUTE_NANS_IN_LOGITS": SAMPLING,
    "VLLM_RAISE_ON_LOGIT_NANS": SAMPLING,
    "VLLM_XGRAMMAR_CACHE_MB": SAMPLING + " (structured outputs)",
    "VLLM_V1_USE_OUTLINES_CACHE": SAMPLING + " (structured outputs)",
    "VLLM_KV_OFFLOAD_MAX_BATCH_DESCRIPTORS": OFFLOAD,
    "VLLM_USE_SIMPLE_KV_OFFLOAD": OFFLOAD,
}

# Variables vLLM 0.32 reads or sets through os.environ without declaring them
# in vllm/envs.py (the test that checks this table's names against vLLM's).
UNDECLARED_BY_VLLM = frozenset(
    {
        "VLLM_DIST_IDENT",
        "VLLM_CPU_SIM_MULTI_NUMA",
        "VLLM_PRECOMPILED_WHEEL_LOCATION",
        "VLLM_SNAPSHOT_TIMEOUT_S",
        "VLLM_MORIIO_TRANSFER_TIMEOUT_S",
    }
)
