"""Checks KVBM's settings where vLLM builds its config, before any engine starts.

``vllm serve`` builds its ``VllmConfig`` in the API server process (``LLM``
in the caller's), then starts the engine core, which imports vLLM again,
starts its workers and loads the model before it creates the connector and
reads KVBM's settings. A misspelt key would stop the start only then, a
minute or more later, as "Engine core initialization failed". Checked here
as well, the same message stops the start in the process the operator
launched, in seconds. The connector still checks when it is created: that
is the check that counts (``load_config``, the one place for settings).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator, Mapping
from typing import Any

from vllm_kvbm.on_import import when_imported
from vllm_kvbm.plugin import CONNECTOR_MODULE, CONNECTOR_NAME


def kvbm_extra_configs(kv_transfer_config: Any) -> Iterator[Mapping[str, Any]]:
    """The ``kv_connector_extra_config`` of each KVBM connector the config
    names: the connector itself, or one of a MultiConnector's."""
    if kv_transfer_config is None:
        return
    yield from _kvbm_in(
        {
            "kv_connector": getattr(kv_transfer_config, "kv_connector", None),
            "kv_connector_module_path": getattr(
                kv_transfer_config, "kv_connector_module_path", None
            ),
            "kv_connector_extra_config": getattr(
                kv_transfer_config, "kv_connector_extra_config", None
            ),
        }
    )


def _kvbm_in(entry: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    extra = entry.get("kv_connector_extra_config") or {}
    if entry.get("kv_connector") == CONNECTOR_NAME or (
        entry.get("kv_connector_module_path") == CONNECTOR_MODULE
    ):
        yield extra
    elif entry.get("kv_connector") == "MultiConnector":
        for child in extra.get("connectors") or []:
            if isinstance(child, Mapping):
                yield from _kvbm_in(child)


def check_engine_config(vllm_config: Any) -> None:
    """Raises KVBMConfigError for the first bad KVBM setting in
    ``vllm_config``, or for a vLLM KVBM does not support. Skipped where no
    engine of this node runs (an API server in front of headless engines
    elsewhere): their files, environment and directories are not this
    process's."""
    parallel = getattr(vllm_config, "parallel_config", None)
    if getattr(parallel, "data_parallel_size_local", 1) == 0:
        return
    from vllm_kvbm.config import load_config
    from vllm_kvbm.config.versions import check_vllm_version

    extras = list(kvbm_extra_configs(getattr(vllm_config, "kv_transfer_config", None)))
    if not extras:
        return
    check_vllm_version()

    # Warnings (a misspelt environment variable) come from the engine core,
    # once, where the settings are used; here only errors matter.
    config_logger = logging.getLogger("vllm_kvbm.config")
    was_disabled, config_logger.disabled = config_logger.disabled, True
    try:
        for extra in extras:
            load_config(extra)
    finally:
        config_logger.disabled = was_disabled


def install() -> None:
    """Checks every config ``EngineArgs.create_engine_config`` builds in
    this process from now on."""
    when_imported("vllm.engine.arg_utils", _patch)


def _patch(module) -> None:
    engine_args = getattr(module, "EngineArgs", None)
    original = getattr(engine_args, "create_engine_config", None)
    if original is None or getattr(original, "__kvbm_checked__", False):
        return

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        vllm_config = original(self, *args, **kwargs)
        check_engine_config(vllm_config)
        return vllm_config

    create_engine_config.__kvbm_checked__ = True  # type: ignore[attr-defined]
    engine_args.create_engine_config = create_engine_config
