"""vLLM's worker methods reviewed as leaving the model's weights alone.

Everything vLLM's engine runs on a worker goes through ``collective_rpc``:
every step (``execute_model``, ``sample_tokens``), startup, LoRA adapters,
health checks, and whatever a user sends (a method name, or a function with
``llm.collective_rpc(fn)``). Keys name the weights the worker runs, so each
call that may change them moves the worker to a private label at once
(worker/loaded_weights.py): a method not in this table, or any function,
counts as such a change. The methods whose loads KVBM can identify are in
``IDENTIFIED``: their pages get a label of what they loaded.

Every method name vLLM 0.32-0.34 sends through ``collective_rpc`` is either
here, in ``SLEEP_MODE`` or in ``NOT_READ_ONLY`` (tests/unit/test_weight_watch_compat.py reads
their sources), so none that vLLM's engine calls while it starts and serves
costs a step more than a set lookup or moves an engine off its files' keys.
"""

from __future__ import annotations

RUN = "runs the model: a step, a dummy batch or the draft tokens of one"
START = "sets the engine up: memory, the KV cache, compilation, warmup"
ASK = "answers a question about the worker"
LORA = (
    "LoRA adapters: the base weights are untouched, and each adapter's own weights "
    "are identified per request (worker/lora_loads.py)"
)
CACHES = "clears a cache of inputs or outputs, not of weights"
KV_MEMORY = "the KV cache's memory (vLLM 0.34's extensible KV cache), not the weights"
READS = "reads the weights (checksums, an inspection, a save to files)"
TRANSFER = (
    "connects to or disconnects from a trainer: the weights change only in "
    "update_weights, between start_weight_update and finish_weight_update"
)

READ_ONLY: dict[str, str] = {
    "execute_model": RUN,
    "sample_tokens": RUN,
    "execute_dummy_batch": RUN,
    "take_draft_token_ids": RUN,
    "init_worker": START,
    "init_device": START,
    "initialize_from_config": START,
    "compile_or_warm_up_model": START,
    "determine_available_memory": START,
    "get_kv_cache_spec": ASK,
    "get_supported_kv_cache_layouts": ASK,
    "set_kv_cache_layout": START,
    "get_kv_connector_handshake_metadata": ASK,
    "get_supported_tasks": ASK,
    "supports_draft_weight_updates": ASK,
    "get_cache_block_size_bytes": ASK,
    "get_encoder_timing_stats": ASK,
    "get_simple_cpu_offload_num_cpu_blocks": ASK,
    "has_incomplete_weight_update": ASK,
    "extensible_kv_cache_unsupported_reason": ASK,
    "extend_kv_cache": KV_MEMORY,
    "disable_extensible_kv_cache": KV_MEMORY,
    "set_kv_cache_reclaimable": KV_MEMORY,
    "check_health": ASK,
    "synchronize_device": ASK,
    "profile": "profiling only",
    "shutdown": "the worker stops",
    "update_environment_variables": START,
    "add_lora": LORA,
    "remove_lora": LORA,
    "pin_lora": LORA,
    "list_loras": LORA,
    "reset_mm_cache": CACHES,
    "reset_encoder_cache": CACHES,
    "release_late_interaction_query_cache": CACHES,
    "compute_weight_checksums": READS,
    "get_model_inspection": READS,
    "save_sharded_state": READS,
    "save_tensorized_model": READS,
    "init_weight_transfer_engine": TRANSFER,
    "shutdown_weight_transfer_engine": TRANSFER,
}

# Methods vLLM sends through collective_rpc that are not read-only, reviewed:
# each moves the worker to a private label (the startup ones run before KVBM
# watches, so only a later call counts).
NOT_READ_ONLY: dict[str, str] = {
    "apply_model": "runs a user's function on the model (LLM.apply_model)",
    "reset_weights": "zeroes the weights (the RL weight checker's reset)",
    "start_draft_weight_update": "updates the draft model's weights, which KVBM does not digest",
    "load_model": "loads the weights (at startup, before KVBM watches)",
    "update_max_model_len": "may rebuild length-dependent tables (at startup, before KVBM watches)",
    "checkpoint_prepare": "checkpoints and restores the process: unreviewed",
    "checkpoint_restore": "checkpoints and restores the process: unreviewed",
    "handle_ft_command": "fault-tolerance commands: unreviewed",
    "elastic_ep_execute": "elastic expert parallelism moves experts between ranks: unreviewed",
    "adjust_rank": "Ray executor (which KVBM cannot watch)",
    "reinitialize_distributed": "Ray executor (which KVBM cannot watch)",
}

# vLLM's sleep mode: followed by wrappers of the worker's methods
# (sleep_mode.py), which release and restore the KV memory and keep or drop
# the weights' label by what each call does to the weights.
SLEEP_MODE: dict[str, str] = {
    "sleep": "level 1 keeps the weights in host memory and maps the same bytes back: the "
    "label stays; level 2 drops them: private until an identified load of them all",
    "wake_up": "maps the memory back (the weights a level-1 sleep kept)",
    "discard": "drops the weights' or the KV cache's memory: for the weights, as level 2",
}

# Weight changes KVBM identifies by what they load (the (name, tensor) pairs
# that pass to the model's load_weights): reload_weights from a path or an
# iterator, and vLLM's weight-transfer API over the engines below.
IDENTIFIED = frozenset(
    {"reload_weights", "start_weight_update", "update_weights", "finish_weight_update"}
)

# Weight-transfer engines (vllm/distributed/weight_transfer/) that hand every
# weight they receive to the model's load_weights (the NCCL one unless vLLM
# 0.34's use_load_plan is on); others (sparse deltas, direct copies into
# parameters) change the weights where KVBM cannot see what: a private label.
LOADING_TRANSFER_ENGINES = frozenset(
    {
        "vllm.distributed.weight_transfer.nccl_engine.NCCLWeightTransferEngine",
        "vllm.distributed.weight_transfer.ipc_engine.IPCWeightTransferEngine",
    }
)
