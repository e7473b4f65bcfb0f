"""vLLM general plugin: makes ``"kv_connector": "KVBMConnector"`` work by name.

vLLM calls ``register()`` through the ``vllm.general_plugins`` entry point
(pyproject.toml) in every process it starts (API server, engine core,
workers), so ``--kv-transfer-config '{"kv_connector": "KVBMConnector",
"kv_role": "kv_both"}'`` needs no ``kv_connector_module_path``.
"""

from __future__ import annotations

CONNECTOR_NAME = "KVBMConnector"


def register() -> None:
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
