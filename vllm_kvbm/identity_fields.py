"""Which of vLLM's config fields decide the KV bytes of a prefix.

Every field of every config dataclass the connector receives inside
``VllmConfig`` (0.32, 0.33 and 0.34) is in ``FIELDS`` as one of:

- ``IDENTITY``: its value goes into ``config_identity()``, which the key
  namespace hashes: engines that differ in it never share pages;
- ``HARMLESS``: it cannot change the KV bytes vLLM computes for a prefix, with
  the reason beside it. Fields whose values differ between engines that
  compute the same KV (ports, ranks, random ids, paths of logs and caches) or
  between the scheduler and worker processes of one engine (values vLLM
  resolves at runtime, in one process only) MUST be harmless or reduced to
  their meaningful part, or replicas would never share, or one engine's two
  sides would disagree on every page name.

A setting not known to be harmless counts as identity: a field this table
does not know (a newer vLLM) is included and logged once. Numerics lean to
identity: anything that selects kernels, fusions, precision or compilation is
identity even where the difference is only rounding, because a page computed
one way and read by an engine running the other way is a mix vLLM itself
never produces (its prefix cache lives inside one engine).

tests/unit/test_identity_fields.py checks that every field of every release
is classified here, and that the values behave (same build, same identity;
hf_overrides, dtype, kv cache dtype or block size changed, another one).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
import re
from pathlib import PurePath
from typing import Any, Callable

logger = logging.getLogger(__name__)

IDENTITY = "identity"
HARMLESS = "harmless"


@dataclasses.dataclass(frozen=True)
class Rule:
    kind: str  # IDENTITY or HARMLESS
    reason: str
    # Reduces a value to its meaningful part before it is hashed.
    reduce: Callable[[Any], Any] | None = None


def I(reason: str = "", reduce: Callable[[Any], Any] | None = None) -> Rule:  # noqa: E743
    return Rule(IDENTITY, reason, reduce)


def H(reason: str) -> Rule:
    return Rule(HARMLESS, reason)


# ---- reducers ------------------------------------------------------------------

# Keys of a transformers config that cannot change what the model computes:
# where it was read from and which transformers wrote it.
HF_CONFIG_DROPPED = frozenset({"_name_or_path", "transformers_version", "_commit_hash"})


def _drop_keys(value: Any, dropped: frozenset[str]) -> Any:
    if isinstance(value, dict):
        return {k: _drop_keys(v, dropped) for k, v in value.items() if k not in dropped}
    if isinstance(value, (list, tuple)):
        return [_drop_keys(v, dropped) for v in value]
    return value


def hf_config_identity(hf_config: Any) -> Any:
    """The effective HF config (after hf_overrides) as canonical data.

    ``to_dict()`` holds every attribute vLLM reads, overrides applied, nested
    configs (text_config, vision_config) included; ``_name_or_path`` (a local
    path that differs between replicas) and ``transformers_version`` are
    dropped at every level. ``architectures`` keeps its order: vLLM runs the
    first one it supports.
    """
    if hf_config is None:
        return None
    data = hf_config.to_dict() if hasattr(hf_config, "to_dict") else hf_config
    return _drop_keys(canonical(data), HF_CONFIG_DROPPED)


def callable_name(value: Any) -> Any:
    """A callable reduced to its qualified name (its effect shows elsewhere,
    e.g. an hf_overrides function in the effective hf_config)."""
    if callable(value) and not isinstance(value, type):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '?')}"
    return canonical(value)


# ---- the table ------------------------------------------------------------------

_RESOLVED = ("resolved by the engine core at runtime, unset in a worker's copy; what it "
             "decides about KV is in the KV cache spec (engine_info)")
_CAPACITY = "how much KV fits, not what it holds"
_SCHED = "which requests run together; the same prefix gets the same KV"
_PORT = "a network address: differs between replicas"
_LOG = "logging or metrics only"
_PROFILE = "profiling only"
_DP = "data parallel replicas of one model compute the same KV"
_PATH = "a file system path: differs between replicas, the content is hashed elsewhere"
_STRUCT = "decoding constraints act on sampled tokens, after the KV of the prefix"
_RUNTIME = ("filled in during model load or compilation in the worker only: the "
            "scheduler's copy differs")
_SPEC_DRAFT = ("drafts are verified by the target model, whose KV is the prefix's; draft "
               "layers' KV follows the draft model (identity)")
_MM_IO = "how multimodal inputs are fetched, cached or shipped, not what they encode to"
_SHAPES = ("which batch shapes get kernels of their own: one engine already computes a "
           "prefix's KV at any batch shape")
_GRAPHS = ("CUDA graphs replay the kernels a batch would run eagerly, and one engine "
           "already runs a prefix with or without them (batches over the largest "
           "capture size run eager)")
_AUTOTUNE = ("autotuning picks among implementations of one op per machine and shape; "
             "the flag does not say which (the elastic EP path toggles it in workers)")
_EXPERT_PLACEMENT = ("which rank holds which expert: every token reaches the same "
                     "experts with the same weights")

FIELDS: dict[str, dict[str, Rule]] = {
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
        "structured_outputs_config": H(_STRUCT),
        "observability_config": H(_LOG),
        "logging_config": H(_LOG),
        "quant_config": H("built from model_config.quantization, quantization_config and "
                          "the hf_config's quantization_config, all identity"),
        "compilation_config": I("compilation and fusions change numerics"),
        "profiler_config": H(_PROFILE),
        "kv_transfer_config": H("how KV moves between engines; KVBM's own page settings "
                                "are in its namespace (engine_info), and its secrets "
                                "must never be hashed into a public name"),
        "kv_events_config": H("KV events are published, the KV is not changed"),
        "ec_transfer_config": H("where encoder outputs are fetched from; the encoder "
                                "settings are in model_config.multimodal_config"),
        "ec_manager_config": H("encoder output cache management"),
        "reasoning_config": H("reasoning parsing acts on generated text"),
        "additional_config": I("platform plugins read it: unknown effect, identity"),
        "instance_id": H("a random id per engine"),
        "optimization_level": I("selects compilation and fusion defaults"),
        "performance_mode": I("selects kernel and compilation defaults"),
        "weight_transfer_config": H("how weight updates arrive; the weights themselves "
                                    "are identity through their hash"),
        "shutdown_timeout": H("shutdown behaviour"),
        "watchdog_config": H("a hang watchdog"),
        "num_hash_lookahead_tokens": H("how far ahead vLLM hashes blocks for lookups"),
    },
    "ModelConfig": {
        "model": H("where the model is (a hub id or a local path that differs between "
                   "replicas); what it computes is its effective hf_config (identity) "
                   "and its weights' hash"),
        "model_weights": H("where the weights came from (a URI when `model` is a local "
                           "staging copy); their content is hashed (fingerprints.py)"),
        "runner": I("generate vs pooling runners build different models"),
        "convert": I("adapters convert the model (e.g. to pooling)"),
        "tokenizer": H("token ids are already in the key"),
        "tokenizer_mode": H("token ids are already in the key"),
        "trust_remote_code": I("remote code may replace the model class"),
        "dtype": I("activation and KV dtype"),
        "seed": H("seeds sampling; the prefill is deterministic in the seed"),
        "hf_config": I("the effective HF config after hf_overrides",
                       reduce=hf_config_identity),
        "hf_text_config": I("the language model's part of hf_config, as vLLM patched it",
                            reduce=hf_config_identity),
        "is_submodel_config": I("a submodel view of a multimodal model"),
        "word_embeddings_untied_by_checkpoint": I("untied embeddings are other weights"),
        "hf_config_path": H(_PATH + " (hf_config)"),
        "allowed_local_media_path": H(_MM_IO),
        "allowed_media_domains": H(_MM_IO),
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
        "enable_prompt_embeds": I("prompt embeddings instead of token ids: unsure, "
                                  "identity"),
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
        "block_size": H("the engine core resets it from the KV cache groups in its own "
                        "process only; the block size the KV is laid out in is the KV "
                        "cache spec's, which the namespace hashes (identity.py)"),
        "user_specified_block_size": H("whether block_size was given; block_size is "
                                       "identity"),
        "kv_cache_layout": H(_RESOLVED),
        "prefix_match_unit": I("where prefix hits can land, finer than blocks: unsure, "
                               "identity"),
        "gpu_memory_utilization": H(_CAPACITY),
        "cache_dtype": I("the KV cache dtype (--kv-cache-dtype)"),
        "is_attention_free": I("attention-free models keep no KV"),
        "num_gpu_blocks_override": H(_CAPACITY),
        "sliding_window": I("which tokens a layer attends to"),
        "enable_prefix_caching": H("KVBM refuses to run without it (engine_info)"),
        "prefix_caching_hash_algo": H("how vLLM names blocks; KVBM's keys bind its "
                                      "own namespace"),
        "prefix_cache_retention_interval": H("how long vLLM keeps blocks"),
        "kv_cache_dtype_skip_layers": I("layers kept in the model dtype"),
        "mamba_page_size_padded": I("state page layout (hybrid models)"),
        "skip_page_size_padded": I("page padding layout"),
        "mamba_block_size": I("state block layout (hybrid models)"),
        "mamba_cache_dtype": I("state dtype (hybrid models)"),
        "mamba_ssm_cache_dtype": I("state dtype (hybrid models)"),
        "mamba_cache_mode": I("state caching mode (hybrid models)"),
        "enable_mamba_shared_prefix_checkpoint": I("state checkpoints (hybrid models)"),
        "replayssm_buffer_len": I("state kernel (hybrid models)"),
        "use_replayssm": I("state kernel (hybrid models)"),
        "use_kda_recoverssm": I("state kernel (hybrid models)"),
        "num_gpu_blocks": H(_CAPACITY + "; set after profiling, in one process"),
        "num_cpu_blocks": H(_CAPACITY),
        "effective_attention_block_size": H(_RESOLVED),
        "kv_cache_size_tokens": H(_CAPACITY),
        "kv_cache_max_concurrency": H(_CAPACITY),
        "hash_block_size": H(_RESOLVED),
        "cache_hit_alignment_tokens": H(_RESOLVED),
        "kv_sharing_fast_prefill": I("layers skip prefill tokens (YOCO)"),
        "swa_bounded_replay": I("sliding-window KV kept out of the cache"),
        "kv_cache_memory_bytes": H(_CAPACITY),
        "kv_offloading_size": H("vLLM's own offloading capacity"),
        "kv_offloading_backend": H("vLLM's own offloading, not the KV computed"),
        "_block_size_resolved": H("whether block_size was resolved; block_size is "
                                  "identity"),
        "simple_cpu_offload_num_blocks": H("vLLM's own offloading capacity"),
        "enable_extensible_kv_cache": H("how the cache grows, resolved by the executor in "
                                        "the engine core only; its layout is the KV cache "
                                        "spec's"),
        "_extensible_kv_cache_resolved": H("whether the option was resolved"),
    },
    "ParallelConfig": {
        "pipeline_parallel_size": I("layers per rank"),
        "tensor_parallel_size": I("KV heads per rank"),
        "prefill_context_parallel_size": I("tokens per rank"),
        "data_parallel_size": H(_DP),
        "data_parallel_size_local": H(_DP),
        "data_parallel_rank": H(_DP),
        "data_parallel_rank_local": H(_DP),
        "data_parallel_master_ip": H(_PORT),
        "data_parallel_rpc_port": H(_PORT),
        "dp_sync_interval": H(_DP),
        "data_parallel_master_port": H(_PORT),
        "data_parallel_backend": H(_DP),
        "data_parallel_external_lb": H(_DP),
        "data_parallel_hybrid_lb": H(_DP),
        "is_moe_model": I("set from the model, which is identity: harmless duplicate, "
                          "kept"),
        "enable_hc_sp": I("sequence-parallel HyperConnection reorders reductions"),
        "enable_expert_parallel": I("expert sharding changes MoE reductions"),
        "enable_batch_sharded_sampling": H("sampling, after the KV"),
        "enable_ep_weight_filter": H(_EXPERT_PLACEMENT),
        "enable_eplb": H(_EXPERT_PLACEMENT),
        "eplb_config": H(_EXPERT_PLACEMENT),
        "expert_placement_strategy": H(_EXPERT_PLACEMENT),
        "all2all_backend": I("all-to-all kernels (and their quantization)"),
        "max_parallel_loading_workers": H("how weights are loaded, not which"),
        "disable_custom_all_reduce": H("one engine already reduces small tensors with the "
                                       "custom kernel and large ones with NCCL; the CPU "
                                       "worker sets it in its own process"),
        "enable_shm_tensor_arena": H("how inputs reach the workers"),
        "enable_elastic_ep": H(_EXPERT_PLACEMENT),
        "elastic_ep_max_dp_size": H(_DP),
        "enable_dbo": I("dual batch overlap splits micro-batches: other kernels"),
        "ubatch_size": I("micro-batch split: other kernels"),
        "dbo_decode_token_threshold": H(_SCHED),
        "dbo_prefill_token_threshold": H(_SCHED),
        "disable_nccl_for_dp_synchronization": H(_DP),
        "ray_workers_use_nsight": H(_PROFILE),
        "ray_runtime_env": H("the Ray environment of the workers"),
        "placement_group": H("where Ray places the workers"),
        "distributed_executor_backend": H("how workers are started"),
        "worker_cls": I("a worker class may run the model differently: unsure, identity"),
        "worker_extension_cls": I("a worker extension may change the model: unsure, "
                                  "identity"),
        "master_addr": H(_PORT),
        "master_port": H(_PORT),
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
        "rank": H("a process's rank: differs between the workers of one engine; the "
                  "rank is bound into each page (page format)"),
        "_data_parallel_master_port_list": H(_PORT),
        "_coord_store_port": H(_PORT),
        "decode_context_parallel_size": I("tokens per rank"),
        "dcp_kv_cache_interleave_size": I("how tokens interleave over ranks"),
        "dcp_comm_backend": I("context-parallel communication: unsure, identity"),
        "dcp_q_replicate": I("context-parallel queries: unsure, identity"),
        "cp_kv_cache_interleave_size": I("how tokens interleave over ranks"),
        "_allow_auto_resolve_cp_interleave_size": H("whether the interleave size may be "
                                                    "resolved; the size is identity"),
        "data_parallel_index": H(_DP),
        "_api_process_count": H("API server processes"),
        "_api_process_rank": H("API server processes"),
        "enable_fault_tolerance": H("engine recovery"),
        "fault_tolerance_config": H("engine recovery"),
        "mori_ep_v2": I("expert-parallel kernels"),
    },
    "SchedulerConfig": {
        "runner_type": I("generate vs pooling"),
        "max_num_batched_tokens": H(_SCHED),
        "max_num_scheduled_tokens": H(_SCHED),
        "max_num_seqs": H(_SCHED),
        "max_num_active_seqs": H(_SCHED),
        "long_prefill_token_threshold": H(_SCHED),
        "long_prefill_token_threshold_adaptive": H(_SCHED),
        "max_num_queued_reqs": H(_SCHED),
        "max_num_queued_tokens": H(_SCHED),
        "enable_chunked_prefill": H("chunks of a prefill compute the same KV as one pass"),
        "is_multimodal_model": H("set from the model, which is identity"),
        "max_num_encoder_input_tokens": H(_SCHED),
        "encoder_cache_size": H(_CAPACITY + " (encoder outputs)"),
        "policy": H(_SCHED),
        "disable_chunked_mm_input": H(_SCHED),
        "scheduler_cls": H("which scheduler class; KVBM keys by tokens and namespace"),
        "disable_hybrid_kv_cache_manager": I("hybrid models' KV groups change; KVBM "
                                             "keeps several groups out, identity anyway"),
        "scheduler_reserve_full_isl": H(_SCHED),
        "watermark": H(_CAPACITY),
        "prefill_schedule_interval": H(_SCHED),
        "async_scheduling": H(_SCHED),
        "stream_interval": H("how often outputs are streamed"),
        "cache_aware_admission_window": H(_SCHED),
        "cache_aware_admission_threshold": H(_SCHED),
        "max_num_inflight_kv_loads": H("how many KV loads run at once"),
    },
    "DeviceConfig": {
        "device": H("the device object (a torch.device with an index that differs "
                    "between ranks); device_type is identity"),
        "device_type": I("the device kind selects kernels"),
    },
    "LoadConfig": {
        "load_format": I("'dummy' loads random weights from the same files"),
        "download_dir": H(_PATH),
        "safetensors_load_strategy": H("how files are read, not which"),
        "safetensors_prefetch_num_threads": H("how files are read, not which"),
        "safetensors_prefetch_block_size": H("how files are read, not which"),
        "model_loader_extra_config": I("loader options (e.g. tensorizer) may change the "
                                       "weights: unsure, identity"),
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
    "AttentionConfig": {
        "backend": I("the attention kernel and its KV layout"),
        "minimax_m3_msa_decode_backend": I("an attention kernel"),
        "backend_per_kind": I("attention kernels per KV group"),
        "flash_attn_version": I("an attention kernel"),
        "flash_attn_max_num_splits_for_cuda_graph": I("split-KV reduction order"),
        "tokenspeed_mla_min_split_kv": I("split-KV reduction order"),
        "tq_max_kv_splits_for_cuda_graph": I("split-KV reduction order"),
        "use_trtllm_attention": I("an attention kernel"),
        "disable_flashinfer_q_quantization": I("query precision"),
        "mla_prefill_backend": I("an attention kernel"),
        "use_prefill_query_quantization": I("query precision"),
        "indexer_kv_dtype": I("the indexer's K cache dtype"),
        "indexer_sparse_logits": I("sparse attention selection"),
        "hisparse_config": I("sparse attention selection"),
        "use_non_causal": I("bidirectional attention computes other KV downstream"),
        "sparse_mla_force_mqa": I("an attention kernel"),
        "sparse_mla_prefill_workspace_factor": I("an attention kernel's workspace: "
                                                 "unsure, identity"),
        "flex_attn_block_m": I("an attention kernel's tiling"),
        "flex_attn_block_n": I("an attention kernel's tiling"),
        "flex_attn_q_block_size": I("an attention kernel's tiling"),
        "flex_attn_kv_block_size": I("an attention kernel's tiling"),
        "trtllm_ragged_backend": I("an attention kernel"),
        "indexer_tp_shard_min_rows": I("indexer sharding: unsure, identity"),
        "minimax_m3_indexer_cp": I("indexer context parallelism: unsure, identity"),
        "indexer_decode_cp": I("indexer context parallelism: unsure, identity"),
        "indexer_logits_dtype": I("indexer precision"),
        "sparse_mla_shard_q": I("an attention kernel"),
        "sparse_mla_shard_q_min_tokens": I("an attention kernel"),
    },
    "HiSparseConfig": {
        "device_buffer_size": I("sparse attention buffers: unsure, identity"),
        "eager_host_mirror": I("sparse attention buffers: unsure, identity"),
    },
    "EngramConfig": {
        "cpu_offload": I("engram embeddings: unsure, identity"),
        "embedding_across_dp": I("engram embeddings: unsure, identity"),
        "dp_shared_memory": I("engram embeddings: unsure, identity"),
        "use_thp": H("transparent huge pages for host memory"),
        "disk_offload": I("engram embeddings: unsure, identity"),
    },
    "DiffusionConfig": {
        "canvas_length": I("diffusion decoding's canvas: unsure, identity"),
        "max_denoising_steps": I("diffusion decoding's steps: unsure, identity"),
    },
    "MambaConfig": {
        "backend": I("state-space kernel"),
        "enable_stochastic_rounding": I("state rounding"),
        "stochastic_rounding_philox_rounds": I("state rounding"),
        "ssu_algorithm": I("state-space kernel"),
    },
    "KernelConfig": {
        "ir_op_priority": I("which implementation of norms and activations"),
        "enable_flashinfer_autotune": H(_AUTOTUNE),
        "enable_rocm_segmented_attn_autotune": H(_AUTOTUNE),
        "enable_cutedsl_warmup": H("warms kernels up before serving"),
        "enable_jit_warmup": H("warms kernels up before serving"),
        "moe_backend": I("MoE kernels"),
        "sparse_indexer_topk_backend": I("sparse attention selection kernel"),
        "linear_backend": I("GEMM kernels"),
        "linear_backend_per_quant": I("GEMM kernels"),
        "monokernel": I("a fused kernel"),
        "enable_rocm_aiter_gemm_warmup": H("warms kernels up before serving"),
        "rdna_hybrid_w4a16_prefill_dequant": I("dequantization path"),
    },
    "IrOpPriorityConfig": {
        "rms_norm": I("norm implementation"),
        "fused_add_rms_norm": I("norm implementation"),
        "gelu_and_mul_sparse": I("activation implementation"),
    },
    "LoRAConfig": {
        "max_lora_rank": I("LoRA kernels are built for the rank: unsure, identity"),
        "max_loras": H("how many adapters are resident at once"),
        "fully_sharded_loras": I("adapter sharding changes reductions"),
        "max_cpu_loras": H("how many adapters are cached on the host"),
        "lora_dtype": I("adapter precision"),
        "target_modules": I("which modules adapters apply to"),
        "default_mm_loras": I("adapters applied to multimodal requests"),
        "enable_tower_connector_lora": I("adapters on the vision tower"),
        "specialize_active_lora": I("LoRA kernels: unsure, identity"),
        "enable_mixed_moe_lora_format": I("MoE adapter format"),
        "enable_moe_shared_loras": I("MoE adapter sharing"),
        "max_lora_cls_labels": H("classification heads, after the KV"),
    },
    "SpeculativeConfig": {
        "enforce_eager": I("the draft's eager or compiled path"),
        "num_speculative_tokens": I("draft layers' KV of accepted tokens may come from "
                                    "drafting passes: unsure, identity"),
        "model": H("where the draft model is; draft_model_config is identity"),
        "method": I("the drafting method (which draft layers hold KV)"),
        "custom_method": I("the drafting method"),
        "draft_tensor_parallel_size": I("the draft's KV heads per rank"),
        "draft_decode_context_parallel_size": I("the draft's tokens per rank"),
        "tensor_parallel_size": I("the draft's KV heads per rank"),
        "quantization": I("the draft's precision"),
        "moe_backend": I("the draft's MoE kernels"),
        "attention_backend": I("the draft's attention kernel"),
        "kv_cache_dtype": I("the draft layers' KV dtype"),
        "max_model_len": I("the draft's RoPE scaling may depend on it"),
        "revision": I("which files of the draft model"),
        "code_revision": I("which remote code of the draft model"),
        "index_share_for_mtp_iteration": I("MTP indexer sharing: unsure, identity"),
        "disable_padded_drafter_batch": H(_SCHED + " (drafter batches)"),
        "disable_eagle_block_drop": I("EAGLE block handling: unsure, identity"),
        "use_local_argmax_reduction": H("sampling of draft tokens, verified by the target"),
        "use_heterogeneous_vocab": I("the draft's vocabulary mapping: unsure, identity"),
        "prompt_lookup_max": H("n-gram drafting proposes tokens, verified by the target"),
        "prompt_lookup_min": H("n-gram drafting proposes tokens, verified by the target"),
        "parallel_drafting": I("the draft's passes: unsure, identity"),
        "target_model_config": H("the engine's own model_config, hashed at "
                                 "VllmConfig.model_config"),
        "target_parallel_config": H("the engine's own parallel_config, hashed at "
                                    "VllmConfig.parallel_config"),
        "num_speculative_tokens_per_batch_size": I("draft lengths: unsure, identity"),
        "draft_model_config": I("the draft model as vLLM runs it"),
        "draft_parallel_config": I("the draft's sharding"),
        "suffix_decoding_max_tree_depth": H(_SPEC_DRAFT),
        "suffix_decoding_max_cached_requests": H(_SPEC_DRAFT),
        "suffix_decoding_max_spec_factor": H(_SPEC_DRAFT),
        "suffix_decoding_min_token_prob": H(_SPEC_DRAFT),
        "suffix_decoding_corpus_tokens": H(_SPEC_DRAFT),
        "draft_load_config": I("how the draft's weights are loaded"),
        "rejection_sample_method": H("acceptance of drafted tokens, after the KV"),
        "synthetic_acceptance_rates": H("acceptance of drafted tokens, after the KV"),
        "synthetic_acceptance_length": H("acceptance of drafted tokens, after the KV"),
        "enable_adaptive_verification": H("how many drafts are verified, after the KV"),
        "draft_sample_method": H("sampling of draft tokens, verified by the target"),
        "dspark_draft_topk": H("sampling of draft tokens, verified by the target"),
        "disable_lookahead_block_hashes": H("how far ahead vLLM hashes blocks"),
        "draft_lm_head_quantization": H("the draft's lm_head proposes tokens, after its KV"),
        "xpress_topc": I("a drafting method's option: unsure, identity"),
        "fly_window_size": I("a drafting method's option: unsure, identity"),
        "fly_entropy_threshold": I("a drafting method's option: unsure, identity"),
        "fly_entropy_top_k": I("a drafting method's option: unsure, identity"),
        "speculator_options": I("a drafting method's options: unsure, identity"),
    },
    "CompilationConfig": {
        "mode": I("compiled and eager paths round differently"),
        "debug_dump_path": H("where debug dumps go"),
        "cache_dir": H("where compiled artifacts are cached (set in the worker)"),
        "compile_cache_save_format": H("how compiled artifacts are saved"),
        "backend": I("the compiler backend"),
        "custom_ops": I("custom or native ops"),
        "ir_enable_torch_wrap": I("how ops are traced: unsure, identity"),
        "splitting_ops": I("graph splits change fusions"),
        "compile_mm_encoder": I("the multimodal encoder's numerics"),
        "cudagraph_mm_encoder": H("replays the same encoder kernels"),
        "encoder_cudagraph_token_budgets": H("graph capture sizes: padding, same kernels"),
        "encoder_cudagraph_max_vision_items_per_batch": H("graph capture sizes"),
        "encoder_cudagraph_max_frames_per_batch": H("graph capture sizes"),
        "encoder_cudagraph_max_token_budget": H("graph capture sizes"),
        "cudagraph_decoder_replay": H(_GRAPHS),
        "decoder_replay_cudagraph_capture_sizes": H("graph capture sizes"),
        "decoder_replay_trim_threshold": H("graph capture sizes"),
        "compile_sizes": H(_SHAPES),
        "compile_ranges_endpoints": H(_SHAPES + " (follows max_num_batched_tokens)"),
        "inductor_compile_config": I("inductor options change kernels"),
        "inductor_passes": I("extra compiler passes"),
        "cudagraph_mode": H(_GRAPHS + "; the GPU worker resolves it in its own process"),
        "cudagraph_num_of_warmups": H("warm-up runs before capture"),
        "cudagraph_capture_sizes": H("graph capture sizes: padding, same kernels"),
        "cudagraph_copy_inputs": H("copies inputs into graph buffers"),
        "cudagraph_specialize_lora": H(_GRAPHS),
        "use_inductor_graph_partition": I("graph partitioning changes fusions"),
        "pass_config": I("fusion passes (quantization points, RoPE+KV write)"),
        "max_cudagraph_capture_size": H("graph capture sizes"),
        "dynamic_shapes_config": I("how shapes are specialised"),
        "local_cache_dir": H("a per-rank compile cache path, set in the worker"),
        "fast_moe_cold_start": I("MoE compilation: unsure, identity"),
        "enabled_custom_ops": H(_RUNTIME),
        "disabled_custom_ops": H(_RUNTIME),
        "traced_files": H(_RUNTIME),
        "compilation_time": H(_RUNTIME),
        "encoder_compilation_time": H(_RUNTIME),
        "static_forward_context": H(_RUNTIME + " (layer objects)"),
        "static_all_moe_layers": H(_RUNTIME),
        "use_breakable_cudagraph": H(_GRAPHS),
        "prefill_cudagraph_capture_token_sizes": H("graph capture sizes"),
        "max_prefill_cudagraph_capture_tokens": H("graph capture sizes"),
        "decode_cudagraph_capture_request_sizes": H("graph capture sizes"),
        "max_decode_cudagraph_capture_requests": H("graph capture sizes"),
        "max_decode_cudagraph_capture_tokens": H("graph capture sizes"),
    },
    "PassConfig": {
        "fuse_norm_quant": I("a fusion"),
        "fuse_act_quant": I("a fusion"),
        "fuse_attn_quant": I("a fusion"),
        "eliminate_noops": I("a graph rewrite: unsure, identity"),
        "fuse_allreduce_rms": I("a fusion"),
        "enable_qk_norm_rope_fusion": I("a fusion (RoPE writes K)"),
        "fuse_rope_kvcache_cat_mla": I("a fusion (writes the KV)"),
        "fuse_act_padding": I("a fusion"),
        "fuse_mla_dual_rms_norm": I("a fusion"),
        "fuse_rope_kvcache": I("a fusion (writes the KV)"),
        "fuse_qk_norm_rope_kvcache": I("a fusion (writes the KV)"),
        "rope_kvcache_fusion_max_token_num": I("which batches take the fused path"),
        "fi_allreduce_fusion_max_size_mb": I("which all-reduces take the fused path"),
    },
    "DynamicShapesConfig": {
        "type": I("how shapes are specialised"),
        "evaluate_guards": I("how shapes are specialised"),
        "assume_32_bit_indexing": I("kernels' index width"),
    },
    "QuantizationConfigArgs": {
        "linear": I("linear layers' precision"),
        "moe": I("MoE layers' precision"),
        "ignore": I("layers left unquantized"),
        "targets": I("which layers are quantized how"),
    },
    "QuantSpec": {
        "weight": I("weight precision"),
        "activation": I("activation precision"),
        "hadamard_size": I("a rotation before quantization"),
        "fields_set": I("which fields were given: decides defaults"),
    },
    "MultiModalConfig": {
        "language_model_only": I("vLLM hashes it into the language model's graph"),
        "limit_per_prompt": H("how many items a prompt may carry"),
        "enable_mm_embeds": I("precomputed embeddings instead of the encoder: unsure, "
                              "identity"),
        "media_io_kwargs": I("how media are decoded (frames, sizes): the embeddings"),
        "mm_processor_kwargs": I("how inputs are processed into embeddings"),
        "mm_device_do_normalize": I("where and how inputs are normalized: other rounding"),
        "mm_processor_cache_gb": H(_MM_IO),
        "mm_processor_cache_type": H(_MM_IO),
        "mm_hasher_algorithm": H("how inputs are named, not what they encode to"),
        "mm_shm_cache_max_object_size_mb": H(_MM_IO),
        "mm_encoder_only": I("encoder-only deployment: unsure, identity"),
        "mm_encoder_tp_mode": I("encoder sharding changes reductions"),
        "mm_encoder_attn_backend": I("the encoder's attention kernel"),
        "mm_encoder_attn_dtype": I("the encoder's precision"),
        "mm_encoder_fp8_scale_path": I("the encoder's fp8 scales (a path: unsure, "
                                       "identity)"),
        "mm_encoder_fp8_scale_save_path": H("where scales are saved"),
        "mm_encoder_fp8_scale_save_margin": H("scales saved, not used"),
        "interleave_mm_strings": I("how text and media interleave in the prompt"),
        "skip_mm_profiling": H("memory profiling"),
        "video_pruning_rate": I("which video tokens are kept"),
        "video_pruning_method": I("which video tokens are kept"),
        "mm_tensor_ipc": H(_MM_IO),
        "allow_missing_mm_embeddings": H("EPD: embeddings come from the encoder instance"),
        "mm_ipc_gpu_memory_gb": H(_MM_IO),
    },
}

# Classes reached only through a HARMLESS field: their fields never reach the
# identity, so they are not classified one by one.
HARMLESS_CLASSES: dict[str, str] = {
    "AuxOutputConfig": "VllmConfig.aux_output_config",
    "WatermarkConfig": "VllmConfig.watermark_config",
    "StructuredOutputsConfig": "VllmConfig.structured_outputs_config",
    "ObservabilityConfig": "VllmConfig.observability_config",
    "LoggingConfig": "VllmConfig.logging_config",
    "ProfilerConfig": "VllmConfig.profiler_config",
    "KVTransferConfig": "VllmConfig.kv_transfer_config",
    "KVEventsConfig": "VllmConfig.kv_events_config",
    "ECTransferConfig": "VllmConfig.ec_transfer_config",
    "EncoderCacheManagerConfig": "VllmConfig.ec_manager_config",
    "ReasoningConfig": "VllmConfig.reasoning_config",
    "WeightTransferConfig": "VllmConfig.weight_transfer_config",
    "WatchdogConfig": "VllmConfig.watchdog_config",
    "PoolerConfig": "ModelConfig.pooler_config",
    "EPLBConfig": "ParallelConfig.eplb_config",
    "FaultToleranceConfig": "ParallelConfig.fault_tolerance_config",
    "UVAOffloadConfig": "OffloadConfig.uva",
    "PrefetchOffloadConfig": "OffloadConfig.prefetch",
}
ROOT_CLASS = "VllmConfig"


# ---- canonical values -------------------------------------------------------------

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+|0x[0-9a-fA-F]{6,}")
# Mapping keys whose values are credentials: never hashed into a public name.
_SECRET_KEY = re.compile(r"(secret|password|passwd|credential|access_key|api_key|"
                         r"private_key|auth_token|hf_token|session_token)", re.I)
_MAX_DEPTH = 12


def canonical(value: Any, _depth: int = 0, _seen: frozenset[int] = frozenset()) -> Any:
    """JSON-able data for a config value: the same for equal configs in any
    process; dataclasses recursively, enums by value, dicts with sorted string
    keys, sets sorted, torch dtypes and devices and paths as str, classes by
    qualified name, never a repr with an address."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else repr(value)
    if _depth > _MAX_DEPTH or id(value) in _seen:
        return f"<{type(value).__qualname__}>"
    seen = _seen | {id(value)}
    deeper = _depth + 1
    if isinstance(value, enum.Enum):
        return canonical(value.value, deeper, seen)
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if isinstance(value, (bytes, bytearray)):
        return value.hex()
    if dataclasses.is_dataclass(value):
        return {"__class__": type(value).__qualname__,
                **{f.name: canonical(getattr(value, f.name, None), deeper, seen)
                   for f in dataclasses.fields(value)}}
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            key = canonical(k, deeper, seen)
            key = key if isinstance(key, str) else json.dumps(key, sort_keys=True)
            out[key] = "<redacted>" if _SECRET_KEY.search(key) else canonical(v, deeper, seen)
        return {k: out[k] for k in sorted(out)}
    if isinstance(value, (set, frozenset)):
        return sorted((canonical(v, deeper, seen) for v in value),
                      key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(value, (list, tuple)):
        return [canonical(v, deeper, seen) for v in value]
    module = type(value).__module__
    if module == "torch" and type(value).__name__ in ("dtype", "device"):
        return str(value)
    if hasattr(value, "to_dict") and callable(value.to_dict):
        return canonical(value.to_dict(), deeper, seen)
    if callable(value):
        return callable_name(value)
    if hasattr(value, "__dict__"):
        return {"__class__": type(value).__qualname__,
                **{k: canonical(v, deeper, seen) for k, v in sorted(vars(value).items())
                   if not k.startswith("_")}}
    return _ADDRESS.sub("", repr(value))


# ---- the identity ------------------------------------------------------------------

_logged_unknown: set[str] = set()


def _config_class(value: Any) -> str | None:
    name = type(value).__name__
    return name if dataclasses.is_dataclass(value) and name in FIELDS else None


def _identity_of(config: Any, cls: str, path: str) -> dict:
    rules = FIELDS[cls]
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        rule = rules.get(f.name)
        value = getattr(config, f.name, None)
        if rule is None:
            where = f"{cls}.{f.name}"
            if where not in _logged_unknown:
                _logged_unknown.add(where)
                logger.info("KVBM: vLLM config field %s (at %s) is not classified in "
                            "vllm_kvbm/identity_fields.py; it counts as identity (pages "
                            "of engines that differ in it are not shared)", where,
                            f"{path}.{f.name}")
        elif rule.kind == HARMLESS:
            continue
        if rule is not None and rule.reduce is not None:
            out[f.name] = rule.reduce(value)
        elif _config_class(value) is not None:
            out[f.name] = _identity_of(value, _config_class(value), f"{path}.{f.name}")
        else:
            out[f.name] = canonical(value)
    return out


def config_identity(vllm_config: Any) -> dict:
    """The IDENTITY fields of ``vllm_config`` as canonical JSON-able data.

    Nested config dataclasses are reduced by their own rows of ``FIELDS``;
    fields the table does not know are included (logged once at INFO). Two
    configs built the same way give equal dicts in any process; hash
    ``json.dumps(config_identity(c), sort_keys=True)`` together with
    ``identity_env()``.
    """
    return _identity_of(vllm_config, ROOT_CLASS, "vllm_config")


# ---- environment -----------------------------------------------------------------

# vLLM environment variables (vllm/envs.py, 0.32-0.34) that select kernels,
# precision or the KV layout. Set ones are identity; unset ones are the same
# default on both sides. Threading, paths, logging and ports are not here.
IDENTITY_ENV = (
    "VLLM_KV_CACHE_LAYOUT",
    "VLLM_BATCH_INVARIANT",
    "VLLM_USE_V2_MODEL_RUNNER",
    "VLLM_MLA_DISABLE",
    "VLLM_DISABLED_KERNELS",
    "VLLM_USE_TRITON_AWQ",
    "VLLM_CPU_ATTN_SPLIT_KV",
    "VLLM_CPU_INT4_W4A8",
    "VLLM_MXFP8_EMULATION_DEQUANT_AT_LOAD",
    "VLLM_MARLIN_USE_ATOMIC_ADD",
    "VLLM_MARLIN_INPUT_DTYPE",
    "VLLM_HUMMING_USE_F16_ACCUM",
    "VLLM_USE_DEEP_GEMM",
    "VLLM_MOE_USE_DEEP_GEMM",
    "VLLM_USE_DEEP_GEMM_E8M0",
    "VLLM_USE_FUSED_MOE_GROUPED_TOPK",
    "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER",
    "VLLM_USE_FLASHINFER_MOE_INT4",
    "VLLM_ROCM_FP8_MFMA_PAGE_ATTN",
    "VLLM_ROCM_FP8_PADDING",
    "VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT",
    "VLLM_ROCM_USE_SKINNY_GEMM",
    "VLLM_ENABLE_INDUCTOR_MAX_AUTOTUNE",
    "VLLM_ENABLE_INDUCTOR_COORDINATE_DESCENT_TUNING",
    "VLLM_USE_STANDALONE_COMPILE",
    "VLLM_USE_AOT_COMPILE",
)
# Whole families that select kernels or precision.
IDENTITY_ENV_PREFIXES = ("VLLM_ROCM_USE_AITER", "VLLM_FLASHINFER_MOE_", "VLLM_USE_FLASHINFER_MOE")


def identity_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The set environment variables that change kernels, precision or layout."""
    environ = os.environ if environ is None else environ
    return {k: environ[k] for k in sorted(environ)
            if k in IDENTITY_ENV or k.startswith(IDENTITY_ENV_PREFIXES)}


def identity_json(vllm_config: Any) -> str:
    """``config_identity`` and ``identity_env`` as canonical JSON text."""
    return json.dumps([config_identity(vllm_config), identity_env()], sort_keys=True,
                      separators=(",", ":"))
