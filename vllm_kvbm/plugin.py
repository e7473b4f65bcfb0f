"""vLLM general plugin: makes ``"kv_connector": "KVBMConnector"`` work by name.

vLLM calls ``register()`` through the ``vllm.general_plugins`` entry point
(pyproject.toml) in every process it starts (API server, engine core,
workers), so ``--kv-transfer-config '{"kv_connector": "KVBMConnector",
"kv_role": "kv_both"}'`` needs no ``kv_connector_module_path``.
"""

from __future__ import annotations

import logging

CONNECTOR_NAME = "KVBMConnector"


class _ToVllmLogger(logging.Handler):
    """Hands records to the "vllm" logger's handlers as they are when the
    record is logged (vLLM reconfigures logging after plugins load)."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger("vllm").handle(record)


def _log_through_vllm() -> None:
    """vllm_kvbm's log records go out where and at the level vLLM's own do
    (VLLM_LOGGING_LEVEL): vLLM configures only its "vllm" logger, so without
    this the connector's INFO lines (tier sizes, key source) are lost."""
    import vllm.envs as envs

    ours = logging.getLogger("vllm_kvbm")
    if ours.handlers or not envs.VLLM_CONFIGURE_LOGGING:
        return  # configured by the application, or vLLM leaves logging alone
    ours.addHandler(_ToVllmLogger())
    ours.setLevel(envs.VLLM_LOGGING_LEVEL)
    ours.propagate = False


def register() -> None:
    _log_through_vllm()
    # Only the factory is imported: the connector itself (and torch, NIXL)
    # loads when an engine asks for it, so a vLLM process that never uses
    # KVBM pays nothing for the plugin.
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # vLLM may call general plugins more than once per process, and
    # register_connector raises on a name it already has.
    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return
    KVConnectorFactory.register_connector(CONNECTOR_NAME, "vllm_kvbm.connector",
                                          CONNECTOR_NAME)
