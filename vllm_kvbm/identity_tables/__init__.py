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

The tables are split by config section (engine.py, kernels.py); the
environment has its own (environment.py: the ``VLLM_*`` variables reviewed as
harmless; every other one set counts as identity).
tests/unit/test_identity_fields.py checks that every field of every release
is classified here, and that the values behave (same build, same identity;
hf_overrides, dtype, kv cache dtype or block size changed, another one).
"""

from __future__ import annotations

from vllm_kvbm.identity_tables.engine import ENGINE_FIELDS
from vllm_kvbm.identity_tables.kernels import KERNEL_FIELDS
from vllm_kvbm.identity_tables.rules import Rule

FIELDS: dict[str, dict[str, Rule]] = {**ENGINE_FIELDS, **KERNEL_FIELDS}

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
