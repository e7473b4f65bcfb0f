"""The identity of a vLLM config: its fields that decide the KV bytes of a
prefix, as canonical data the key namespace hashes.

``config_identity`` walks ``VllmConfig`` by the reviewed tables
(identity_tables/: each field IDENTITY or HARMLESS, with the reason) and
keeps the IDENTITY fields, canonical (canonical_values.py); a field the
tables do not know counts as identity (logged once). ``identity_env`` adds
the environment variables that select kernels, precision or the KV layout.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

from vllm_kvbm.canonical_values import canonical
from vllm_kvbm.identity_tables import FIELDS, ROOT_CLASS
from vllm_kvbm.identity_tables.rules import HARMLESS

logger = logging.getLogger(__name__)


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
                            "vllm_kvbm/identity_tables/; it counts as identity (pages "
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
