"""The reviewed fields of the config sections that set the engine up: the
model, the KV cache, parallelism, scheduling, the device, weight loading and
offloading (and ``VllmConfig`` itself, the root)."""

from __future__ import annotations

from vllm_kvbm.canonical_values import callable_name, hf_config_identity
from vllm_kvbm.identity_tables.rules import (
    CAPACITY,
    DP,
    EXPERT_PLACEMENT,
    LOG,
    MM_IO,
    PATH,
    PORT,
    PROFILE,
    RESOLVED,
    SCHED,
    STRUCT,
    H,
    I,
    Rule,
)

ENGINE_FIELDS: dict[str, dict[str, Rule]] = {
    "VllmConfig": {
        "model_config": I("the model as vLLM runs it"),
        "cache_config": I("block size, KV dtype, skipped layers"),
        "parallel_config": I("sharding of the KV heads and experts"),
        "scheduler_config": I("nested: every field of it is harmless but runner type"),
        "device_config": I("the device kind selects kernels"),
        "load_config": I("which weights are loaded and how"),
        "offload_config": I("nested: weight offloading, classified per field"),
        "attention_config": I("attention backend and its options"),
        "aux_output_config": H("extra outputs returned beside tokens"),
        "engram_config": I("engram embedding placement: unsure, identity"),
        "mamba_config": I("state-space kernels (hybrid models)"),
        "kernel_config": I("kernel selection"),
        "lora_config": I("LoRA dtype and sharding change adapter numerics"),
        "speculative_config": I("draft model layers hold KV too"),
        "watermark_config": H("watermarking biases sampling, after the KV"),
        "diffusion_config": I("diffusion decoding: unsure, identity"),
        "structured_outputs_config": H(STRUCT),
        "observability_config": H(LOG),
        "logging_config": H(LOG),
        "quant_config": H(
            "built from model_config.quantization, quantization_config and "
            "the hf_config's quantization_config, all identity"
        ),
        "compilation_config": I("compilation and fusions change numerics"),
        "profiler_config": H(PROFILE),
        "kv_transfer_config": H(
            "how KV moves between engines; KVBM's own page settings "
            "are in its namespace (engine_info), and its secrets "
            "must never be hashed into a public name"
        ),
        "kv_events_config": H("KV events are published, the KV is not changed"),
        "ec_transfer_config": H(
            "where encoder outputs are fetched from; the encoder "
            "settings are in model_config.multimodal_config"
        ),
        "ec_manager_config": H("encoder output cache management"),
        "reasoning_config": H("reasoning parsing acts on generated text"),
        "additional_config": I("platform plugins read it: unknown effect, identity"),
        "instance_id": H("a random id per engine"),
        "optimization_level": I("selects compilation and fusion defaults"),
        "performance_mode": I("selects kernel and compilation defaults"),
        "weight_transfer_config": H(
            "how weight updates arrive; the weights themselves are identity through their hash"
        ),
        "shutdown_timeout": H("shutdown behaviour"),
        "watchdog_config": H("a hang watchdog"),
        "num_hash_lookahead_tokens": H("how far ahead vLLM hashes blocks for lookups"),
    },
    "ModelConfig": {
        "model": H(
            "where the model is (a hub id or a local path that differs between "
            "replicas); what it computes is its effective hf_config (identity) "
            "and its weights' hash"
        ),
        "model_weights": H(
            "where the weights came from (a URI when `model` is a local "
            "staging copy); their content is hashed (fingerprints.py)"
        ),
        "runner": I("generate vs pooling runners build different models"),
        "convert": I("adapters convert the model (e.g. to pooling)"),
        "tokenizer": H("token ids are already in the key"),
        "tokenizer_mode": H("token ids are already in the key"),
        "trust_remote_code": I("remote code may replace the model class"),
        "dtype": I("activation and KV dtype"),
        "seed": H("seeds sampling; the prefill is deterministic in the seed"),
        "hf_config": I("the effective HF config after hf_overrides", reduce=hf_config_identity),
        "hf_text_config": I(
            "the language model's part of hf_config, as vLLM patched it", reduce=hf_config_identity
        ),
        "is_submodel_config": I("a submodel view of a multimodal model"),
        "word_embeddings_untied_by_checkpoint": I("untied embeddings are other weights"),
        "hf_config_path": H(PATH + " (hf_config)"),
        "allowed_local_media_path": H(MM_IO),
        "allowed_media_domains": H(MM_IO),
        "revision": I("which files of a hub model"),
        "code_revision": I("which remote code of a hub model"),
        "tokenizer_revision": H("token ids are already in the key"),
        "max_model_len": I("RoPE scaling (dynamic NTK, LongRoPE) can depend on it"),
        "spec_target_max_model_len": H("a draft model's cap on the target's length"),
        "quantization": I("weight and activation precision"),
        "quantization_config": I("weight and activation precision"),
        "allow_deprecated_quantization": H("allows a method, which `quantization` names"),
        "enforce_eager": I("eager and compiled paths round differently"),
        "return_sampling_mask": H("an output after sampling"),
        "max_logprobs": H("an output after sampling"),
        "logprobs_mode": H("an output after sampling"),
        "use_fp64_gumbel": H("sampling precision, after the KV"),
        "enable_trace_replay": H("records traces"),
        "disable_sliding_window": I("changes the attention a layer computes"),
        "disable_cascade_attn": I("cascade attention is another kernel"),
        "skip_tokenizer_init": H("token ids are already in the key"),
        "enable_prompt_embeds": I("prompt embeddings instead of token ids: unsure, identity"),
        "served_model_name": H("the name the API answers to"),
        "config_format": H("how the config was read; its content is hf_config"),
        "hf_token": H("a credential, never hashed or logged"),
        "hf_overrides": I("overrides of the HF config", reduce=callable_name),
        "model_class_overrides": I("another model class"),
        "generation_config": H("sampling defaults, after the KV"),
        "override_generation_config": H("sampling defaults, after the KV"),
        "enable_sleep_mode": H("memory release between requests"),
        "sleep_preserve_parameter_names": H("memory release between requests"),
        "sleep_mode_backend": H("memory release between requests"),
        "sleep_mode_offload_cudagraph": H("memory release between requests"),
        "enable_nccl_comm_suspend": H("communicator memory release"),
        "enable_cumem_allocator": H("a memory allocator"),
        "model_impl": I("vLLM's or transformers' implementation of the model"),
        "logits_processors": H("act on logits, after the KV"),
        "io_processor_plugin": H("pre- and post-processing of a pooling model's I/O"),
        "renderer_num_workers": H("threads that render prompts"),
        "pooler_config": H("pooling runs on hidden states, after the KV"),
        "multimodal_config": I("multimodal encoding decides the KV of placeholder tokens"),
        "checkpoint_prepare_on_startup": H("when the checkpoint is prepared"),
    },
    "CacheConfig": {
        "block_size": H(
            "the engine core resets it from the KV cache groups in its own "
            "process only; the block size the KV is laid out in is the KV "
            "cache spec's, which the namespace hashes (identity.py)"
        ),
        "user_specified_block_size": H("whether block_size was given; block_size is identity"),
        "kv_cache_layout": H(RESOLVED),
        "prefix_match_unit": I("where prefix hits can land, finer than blocks: unsure, identity"),
        "gpu_memory_utilization": H(CAPACITY),
        "cache_dtype": I("the KV cache dtype (--kv-cache-dtype)"),
        "is_attention_free": I("attention-free models keep no KV"),
        "num_gpu_blocks_override": H(CAPACITY),
        "sliding_window": I("which tokens a layer attends to"),
        "enable_prefix_caching": H("KVBM refuses to run without it (engine_info)"),
        "prefix_caching_hash_algo": H("how vLLM names blocks; KVBM's keys bind its own namespace"),
        "prefix_cache_retention_interval": H("how long vLLM keeps blocks"),
        "kv_cache_dtype_skip_layers": I("layers kept in the model dtype"),
        "mamba_page_size_padded": H(
            "set in one process only (vLLM's hybrid model config, "
            "in the worker); the state's page padding is the "
            "MambaSpec's, which the namespace hashes (kv_spec)"
        ),
        "skip_page_size_padded": I("page padding layout"),
        "mamba_block_size": H(
            "set in one process only (vLLM's hybrid model config, in the "
            "worker); the state's block size is the MambaSpec's, which "
            "the namespace hashes (kv_spec)"
        ),
        "mamba_cache_dtype": I("state dtype (hybrid models)"),
        "mamba_ssm_cache_dtype": I("state dtype (hybrid models)"),
        "mamba_cache_mode": I("state caching mode (hybrid models)"),
        "enable_mamba_shared_prefix_checkpoint": I("state checkpoints (hybrid models)"),
        "replayssm_buffer_len": I("state kernel (hybrid models)"),
        "use_replayssm": I("state kernel (hybrid models)"),
        "use_kda_recoverssm": I("state kernel (hybrid models)"),
        "num_gpu_blocks": H(CAPACITY + "; set after profiling, in one process"),
        "num_cpu_blocks": H(CAPACITY),
        "effective_attention_block_size": H(RESOLVED),
        "kv_cache_size_tokens": H(CAPACITY),
        "kv_cache_max_concurrency": H(CAPACITY),
        "hash_block_size": H(RESOLVED),
        "cache_hit_alignment_tokens": H(RESOLVED),
        "kv_sharing_fast_prefill": I("layers skip prefill tokens (YOCO)"),
        "swa_bounded_replay": I("sliding-window KV kept out of the cache"),
        "kv_cache_memory_bytes": H(CAPACITY),
        "kv_offloading_size": H("vLLM's own offloading capacity"),
        "kv_offloading_backend": H("vLLM's own offloading, not the KV computed"),
        "_block_size_resolved": H("whether block_size was resolved; block_size is identity"),
        "simple_cpu_offload_num_blocks": H("vLLM's own offloading capacity"),
        "enable_extensible_kv_cache": H(
            "how the cache grows, resolved by the executor in "
            "the engine core only; its layout is the KV cache "
            "spec's"
        ),
        "_extensible_kv_cache_resolved": H("whether the option was resolved"),
    },
    "ParallelConfig": {
        "pipeline_parallel_size": I("layers per rank"),
        "tensor_parallel_size": I("KV heads per rank"),
        "prefill_context_parallel_size": I("tokens per rank"),
        "data_parallel_size": H(DP),
        "data_parallel_size_local": H(DP),
        "data_parallel_rank": H(DP),
        "data_parallel_rank_local": H(DP),
        "data_parallel_master_ip": H(PORT),
        "data_parallel_rpc_port": H(PORT),
        "dp_sync_interval": H(DP),
        "data_parallel_master_port": H(PORT),
        "data_parallel_backend": H(DP),
        "data_parallel_external_lb": H(DP),
        "data_parallel_hybrid_lb": H(DP),
        "is_moe_model": I("set from the model, which is identity: harmless duplicate, kept"),
        "enable_hc_sp": I("sequence-parallel HyperConnection reorders reductions"),
        "enable_expert_parallel": I("expert sharding changes MoE reductions"),
        "enable_batch_sharded_sampling": H("sampling, after the KV"),
        "enable_ep_weight_filter": H(EXPERT_PLACEMENT),
        "enable_eplb": H(EXPERT_PLACEMENT),
        "eplb_config": H(EXPERT_PLACEMENT),
        "expert_placement_strategy": H(EXPERT_PLACEMENT),
        "all2all_backend": I("all-to-all kernels (and their quantization)"),
        "max_parallel_loading_workers": H("how weights are loaded, not which"),
        "disable_custom_all_reduce": H(
            "one engine already reduces small tensors with the "
            "custom kernel and large ones with NCCL; the CPU "
            "worker sets it in its own process"
        ),
        "enable_shm_tensor_arena": H("how inputs reach the workers"),
        "enable_elastic_ep": H(EXPERT_PLACEMENT),
        "elastic_ep_max_dp_size": H(DP),
        "enable_dbo": I("dual batch overlap splits micro-batches: other kernels"),
        "ubatch_size": I("micro-batch split: other kernels"),
        "dbo_decode_token_threshold": H(SCHED),
        "dbo_prefill_token_threshold": H(SCHED),
        "disable_nccl_for_dp_synchronization": H(DP),
        "ray_workers_use_nsight": H(PROFILE),
        "ray_runtime_env": H("the Ray environment of the workers"),
        "placement_group": H("where Ray places the workers"),
        "distributed_executor_backend": H("how workers are started"),
        "worker_cls": I("a worker class may run the model differently: unsure, identity"),
        "worker_extension_cls": I("a worker extension may change the model: unsure, identity"),
        "master_addr": H(PORT),
        "master_port": H(PORT),
        "node_rank": H("this node's rank: differs between the nodes of one engine"),
        "nnodes": H("nodes that hold the same ranks"),
        "numa_bind": H("CPU placement"),
        "numa_bind_nodes": H("CPU placement"),
        "numa_bind_cpus": H("CPU placement"),
        "_numa_bind_auto": H("CPU placement"),
        "assigned_physical_gpu_ids": H("which GPUs: differs between replicas"),
        "distributed_timeout_seconds": H("a timeout"),
        "cpu_distributed_timeout_seconds": H("a timeout"),
        "world_size": I("ranks of one engine (TP x PP x PCP)"),
        "rank": H(
            "a process's rank: differs between the workers of one engine; the "
            "rank is bound into each page (page format)"
        ),
        "_data_parallel_master_port_list": H(PORT),
        "_coord_store_port": H(PORT),
        "decode_context_parallel_size": I("tokens per rank"),
        "dcp_kv_cache_interleave_size": I("how tokens interleave over ranks"),
        "dcp_comm_backend": I("context-parallel communication: unsure, identity"),
        "dcp_q_replicate": I("context-parallel queries: unsure, identity"),
        "cp_kv_cache_interleave_size": I("how tokens interleave over ranks"),
        "_allow_auto_resolve_cp_interleave_size": H(
            "whether the interleave size may be resolved; the size is identity"
        ),
        "data_parallel_index": H(DP),
        "_api_process_count": H("API server processes"),
        "_api_process_rank": H("API server processes"),
        "enable_fault_tolerance": H("engine recovery"),
        "fault_tolerance_config": H("engine recovery"),
        "mori_ep_v2": I("expert-parallel kernels"),
    },
    "SchedulerConfig": {
        "runner_type": I("generate vs pooling"),
        "max_num_batched_tokens": H(SCHED),
        "max_num_scheduled_tokens": H(SCHED),
        "max_num_seqs": H(SCHED),
        "max_num_active_seqs": H(SCHED),
        "long_prefill_token_threshold": H(SCHED),
        "long_prefill_token_threshold_adaptive": H(SCHED),
        "max_num_queued_reqs": H(SCHED),
        "max_num_queued_tokens": H(SCHED),
        "enable_chunked_prefill": H("chunks of a prefill compute the same KV as one pass"),
        "is_multimodal_model": H("set from the model, which is identity"),
        "max_num_encoder_input_tokens": H(SCHED),
        "encoder_cache_size": H(CAPACITY + " (encoder outputs)"),
        "policy": H(SCHED),
        "disable_chunked_mm_input": H(SCHED),
        "scheduler_cls": H("which scheduler class; KVBM keys by tokens and namespace"),
        "disable_hybrid_kv_cache_manager": I(
            "hybrid models' KV groups change; KVBM keeps several groups out, identity anyway"
        ),
        "scheduler_reserve_full_isl": H(SCHED),
        "watermark": H(CAPACITY),
        "prefill_schedule_interval": H(SCHED),
        "async_scheduling": H(SCHED),
        "stream_interval": H("how often outputs are streamed"),
        "cache_aware_admission_window": H(SCHED),
        "cache_aware_admission_threshold": H(SCHED),
        "max_num_inflight_kv_loads": H("how many KV loads run at once"),
    },
    "DeviceConfig": {
        "device": H(
            "the device object (a torch.device with an index that differs "
            "between ranks); device_type is identity"
        ),
        "device_type": I("the device kind selects kernels"),
    },
    "LoadConfig": {
        "load_format": I("'dummy' loads random weights from the same files"),
        "download_dir": H(PATH),
        "safetensors_load_strategy": H("how files are read, not which"),
        "safetensors_prefetch_num_threads": H("how files are read, not which"),
        "safetensors_prefetch_block_size": H("how files are read, not which"),
        "model_loader_extra_config": I(
            "loader options (e.g. tensorizer) may change the weights: unsure, identity"
        ),
        "device": I("where weights are loaded: unsure, identity"),
        "ignore_patterns": I("which weight files are loaded"),
        "use_tqdm_on_load": H("a progress bar"),
        "pt_load_map_location": H("where .pt files are staged while loading"),
        "shuffle_safetensors_files": H("the order files are read in"),
    },
    "OffloadConfig": {
        "offload_backend": H("where weights wait between uses; the same weights run"),
        "uva": H("where weights wait between uses; the same weights run"),
        "prefetch": H("where weights wait between uses; the same weights run"),
    },
}
