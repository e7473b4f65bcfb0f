"""Facts about the engine that both connector sides derive identically.

The scheduler and the worker run in different processes; each computes the
block size, the bytes of one block and the key namespace from the same
vLLM config, so they agree on slot counts and keys without a handshake.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_kvbm.config import KVBMConfigError
from vllm_kvbm.keys import KeyNamespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(frozen=True)
class EngineInfo:
    block_size: int
    # Bytes of one block on one worker: every layer's K and V pages.
    block_bytes: int
    num_layers: int
    num_workers: int
    key_namespace: KeyNamespace

    @property
    def tier_namespace(self) -> str:
        """What the disk and remote tiers file this engine's pages under."""
        return self.key_namespace.seed().hex()


def engine_info(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig",
                namespace: str = "") -> EngineInfo:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
        kinds = sorted({type(g.kv_cache_spec).__name__ for g in groups})
        raise KVBMConfigError(
            f"KVBMConnector supports models whose layers all use full attention "
            f"(one KV cache group); this model has {len(groups)} group(s) of "
            f"{', '.join(kinds)}. Remove --kv-transfer-config for this model.")
    spec = groups[0].kv_cache_spec
    if not vllm_config.cache_config.enable_prefix_caching:
        raise KVBMConfigError(
            "enable_prefix_caching: KVBMConnector needs vLLM's prefix caching "
            "(it stores and finds blocks by prefix); remove --no-enable-prefix-caching")
    num_layers = len(groups[0].layer_names)
    parallel = vllm_config.parallel_config
    model = vllm_config.model_config
    namespace_key = KeyNamespace(
        model=f"{model.model}@{getattr(model, 'revision', None) or ''}",
        dtype=str(spec.dtype),
        kv_layout=str(kv_cache_config.kv_cache_layout or ""),
        block_size=spec.block_size,
        block_bytes=spec.page_size_bytes * num_layers,
        # Scheduler-side keys name a block for every TP rank at once; the
        # disk and remote stores add the rank to their own page names.
        tp_rank=0,
        tp_size=parallel.tensor_parallel_size,
        extra=namespace,
    )
    return EngineInfo(
        block_size=spec.block_size,
        block_bytes=spec.page_size_bytes * num_layers,
        num_layers=num_layers,
        num_workers=parallel.world_size,
        key_namespace=namespace_key,
    )

