"""Canonical JSON-able data for vLLM config values: the same for equal
configs in any process, never a repr with an address, never a credential.

What ``identity_fields.config_identity`` hashes is built from these; the
reducers here also shrink a field to its meaningful part before it is hashed
(the effective HF config without where it was read from, a callable by name).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from pathlib import PurePath
from typing import Any

# ---- reducers ------------------------------------------------------------------

# Keys of a transformers config that cannot change what the model computes:
# where it was read from and which transformers wrote it.
# ... and the fields vLLM's model code rewrites in the worker process only,
# named by the value the model runs with instead (identity.model_run_fields)
HF_CONFIG_DROPPED = frozenset(
    {"_name_or_path", "transformers_version", "_commit_hash", "attn_temperature_tuning"}
)


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


# ---- canonical values -------------------------------------------------------------

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+|0x[0-9a-fA-F]{6,}")
# Mapping keys whose values are credentials: never hashed into a public name.
_SECRET_KEY = re.compile(
    r"(secret|password|passwd|credential|access_key|api_key|"
    r"private_key|auth_token|hf_token|session_token)",
    re.I,
)
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
        return {
            "__class__": type(value).__qualname__,
            **{
                f.name: canonical(getattr(value, f.name, None), deeper, seen)
                for f in dataclasses.fields(value)
            },
        }
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            key = canonical(k, deeper, seen)
            key = key if isinstance(key, str) else json.dumps(key, sort_keys=True)
            out[key] = "<redacted>" if _SECRET_KEY.search(key) else canonical(v, deeper, seen)
        return {k: out[k] for k in sorted(out)}
    if isinstance(value, (set, frozenset)):
        return sorted(
            (canonical(v, deeper, seen) for v in value), key=lambda v: json.dumps(v, sort_keys=True)
        )
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
        return {
            "__class__": type(value).__qualname__,
            **{
                k: canonical(v, deeper, seen)
                for k, v in sorted(vars(value).items())
                if not k.startswith("_")
            },
        }
    return _ADDRESS.sub("", repr(value))
