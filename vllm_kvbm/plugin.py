"""vLLM general plugin: makes ``"kv_connector": "KVBMConnector"`` work by name.

vLLM calls ``register()`` through the ``vllm.general_plugins`` entry point
(pyproject.toml) in every process it starts (API server, engine core,
workers), so ``--kv-transfer-config '{"kv_connector": "KVBMConnector",
"kv_role": "kv_both"}'`` needs no ``kv_connector_module_path``.
"""

from __future__ import annotations

import logging

CONNECTOR_NAME = "KVBMConnector"
CONNECTOR_MODULE = "vllm_kvbm.connector"


class _ToVllmHandlers(logging.Handler):
    """Hands records to the "vllm" logger's handlers, looked up when the
    record is logged (vLLM configures logging after plugins load), except
    those the record reaches anyway through its own loggers' propagation
    (the root's, or handlers attached to both)."""

    def emit(self, record: logging.LogRecord) -> None:
        vllm = logging.getLogger("vllm")
        if vllm.propagate:
            return  # vLLM's records and ours end at the same handlers
        for handler in vllm.handlers:
            if record.levelno >= handler.level and handler not in _reached(record.name):
                handler.handle(record)


def _reached(name: str) -> set[logging.Handler]:
    """The handlers a record of logger ``name`` reaches by propagation."""
    found: set[logging.Handler] = set()
    logger: logging.Logger | None = logging.getLogger(name)
    while logger is not None:
        found.update(logger.handlers)
        logger = logger.parent if logger.propagate else None
    return found


def _log_through_vllm() -> None:
    """vllm_kvbm's log records also go out where vLLM's own do, from vLLM's
    level on (VLLM_LOGGING_LEVEL): vLLM configures only its "vllm" logger, so
    without this the connector's INFO lines (tier sizes, key source) are lost.
    Nothing else changes: the records still propagate to the application's
    handlers, and a level the application set lower is kept."""
    import vllm.envs as envs

    ours = logging.getLogger("vllm_kvbm")
    if not envs.VLLM_CONFIGURE_LOGGING or any(
        isinstance(h, _ToVllmHandlers) for h in ours.handlers
    ):
        return
    level = logging.getLevelName(str(envs.VLLM_LOGGING_LEVEL).upper())
    if isinstance(level, int) and ours.getEffectiveLevel() > level:
        ours.setLevel(level)
    ours.addHandler(_ToVllmHandlers())


def register() -> None:
    _log_through_vllm()
    # Before vLLM loads a model in this process: which weight files it picks
    # (the keys must name those, unchanged: opened_files.py). Patched when
    # vLLM's loader is first imported, so costs nothing here.
    from vllm_kvbm import opened_files

    opened_files.install()
    # A bad KVBM setting stops `vllm serve` (or LLM(...)) where vLLM builds
    # its config, before an engine core starts (startup_check.py).
    from vllm_kvbm import startup_check

    startup_check.install()
    # Only the factory is imported: the connector itself (and torch, NIXL)
    # loads when an engine asks for it, so a vLLM process that never uses
    # KVBM pays nothing for the plugin.
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # vLLM may call general plugins more than once per process, and
    # register_connector raises on a name it already has.
    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return
    KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
