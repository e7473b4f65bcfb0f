"""Which dimension of each layer's KV cache holds the blocks, as vLLM declares it.

vLLM 0.32 hands ``register_kv_caches`` one view per layer whose logical shape
is ``compute_layer_kv_cache_shape_bytes(spec, num_blocks)`` (``[blocks, heads,
tokens, content]``), with strides from the resolved ``KVCacheLayout``
(vllm/v1/kv_cache_interface.py: ``create_kv_cache_views``). As vLLM's
NixlConnector once did with the attention backend's ``get_kv_cache_shape``,
the shape function is called with a sentinel block count: the dimension that
comes back holding the sentinel is the block dimension, whatever sizes the
other dimensions have (with num_blocks == 2 or == num_kv_heads, "the
dimension of size num_blocks" is ambiguous).

Imports vLLM only when called: the worker side must import without vLLM.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)

# A block count no other dimension of a KV page can have.
_SENTINEL = 1_000_003


def layer_specs(kv_cache_config: "KVCacheConfig") -> dict:
    """layer name -> its own KV cache spec (a UniformTypeKVCacheSpecs group
    holds one per layer)."""
    specs = {}
    for group in kv_cache_config.kv_cache_groups:
        per_layer = getattr(group.kv_cache_spec, "kv_cache_specs", None) or {}
        for name in group.layer_names:
            specs[name] = per_layer.get(name, group.kv_cache_spec)
    return specs


def declared_block_dims(
    kv_cache_config: "KVCacheConfig", kv_caches: dict[str, "torch.Tensor"]
) -> dict[str, int] | None:
    """layer -> block dim from vLLM's declared layout; None without vLLM's
    layout function. A layer left out is located from its shape, and only if
    that is unambiguous (vllm_kvbm.worker.kv_regions.block_dim_of)."""
    try:
        from vllm.v1.kv_cache_interface import compute_layer_kv_cache_shape_bytes
    except ImportError:
        logger.warning(
            "KVBM: this vLLM declares no per-layer KV cache shape; block "
            "dimensions are found from the tensors' shapes"
        )
        return None
    specs = layer_specs(kv_cache_config)
    dims: dict[str, int] = {}
    for name, t in kv_caches.items():
        spec = specs.get(name)
        if spec is None:
            continue
        shape = compute_layer_kv_cache_shape_bytes(spec, _SENTINEL)
        hits = [i for i, n in enumerate(shape) if n == _SENTINEL]
        if len(hits) != 1 or len(shape) != t.dim():
            logger.warning(
                "KVBM: layer %s: vLLM declares a KV cache shape %s that does "
                "not describe its %d-dim tensor; its block dimension is found "
                "from the shape",
                name,
                shape,
                t.dim(),
            )
            continue
        dims[name] = hits[0]
    return dims
