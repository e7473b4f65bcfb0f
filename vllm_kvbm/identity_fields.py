"""The identity of a vLLM config: its fields that decide the KV bytes of a
prefix, as canonical data the key namespace hashes.

``config_identity`` walks ``VllmConfig`` by the reviewed tables
(identity_tables/: each field IDENTITY or HARMLESS, with the reason) and
keeps the IDENTITY fields, canonical (canonical_values.py); a field the
tables do not know counts as identity (logged once). ``identity_env`` adds
every ``VLLM_*`` environment variable set and not reviewed as harmless.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

from vllm_kvbm.canonical_values import canonical
from vllm_kvbm.identity_tables import FIELDS, ROOT_CLASS
from vllm_kvbm.identity_tables.environment import HARMLESS_ENV
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
                logger.info(
                    "KVBM: vLLM config field %s (at %s) is not classified in "
                    "vllm_kvbm/identity_tables/; it counts as identity (pages "
                    "of engines that differ in it are not shared)",
                    where,
                    f"{path}.{f.name}",
                )
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


def identity_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The set ``VLLM_*`` variables not reviewed as harmless
    (identity_tables/environment.py): one vLLM reads may select a kernel, a
    precision or a routing, so a variable that table does not list counts."""
    environ = os.environ if environ is None else environ
    return {
        k: environ[k] for k in sorted(environ) if k.startswith("VLLM_") and k not in HARMLESS_ENV
    }


def identity_json(vllm_config: Any) -> str:
    """``config_identity`` and ``identity_env`` as canonical JSON text."""
    return json.dumps(
        [config_identity(vllm_config), identity_env()], sort_keys=True, separators=(",", ":")
    )
