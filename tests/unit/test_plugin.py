"""The vllm.general_plugins entry point that registers the name KVBMConnector."""

from __future__ import annotations

from importlib.metadata import entry_points

from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

from vllm_kvbm.connector import KVBMConnector


def test_entry_point_is_declared_and_loads_register():
    [ep] = [
        e for e in entry_points(group="vllm.general_plugins") if e.value.startswith("vllm_kvbm.")
    ]
    assert ep.value == "vllm_kvbm.plugin:register"
    from vllm_kvbm.plugin import register

    assert ep.load() is register


def test_register_is_idempotent_and_the_name_resolves():
    from vllm_kvbm.plugin import register

    register()
    register()  # vLLM's register_connector raises on a second call: guarded
    config = KVTransferConfig(kv_connector="KVBMConnector", kv_role="kv_both")
    assert config.kv_connector_module_path is None
    assert KVConnectorFactory.get_connector_class(config) is KVBMConnector


def test_vllm_loads_it_as_a_general_plugin():
    import vllm.plugins as plugins

    loaded = plugins.load_plugins_by_group(plugins.DEFAULT_PLUGINS_GROUP)
    assert loaded["kvbm"].__module__ == "vllm_kvbm.plugin"


def test_connector_logs_go_where_vllms_go(monkeypatch):
    """vLLM configures only its "vllm" logger: the plugin hands vllm_kvbm's
    records to it, so the connector's INFO lines show up under vllm serve."""
    import logging

    from vllm_kvbm.plugin import register

    monkeypatch.setattr(logging.getLogger("vllm_kvbm"), "handlers", [])
    register()
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    vllm_logger = logging.getLogger("vllm")
    monkeypatch.setattr(vllm_logger, "propagate", False)  # as vLLM's logging config sets it
    keep = Keep()
    vllm_logger.addHandler(keep)
    try:
        logging.getLogger("vllm_kvbm.connector").warning("KVBM: seen by vLLM's handlers")
    finally:
        vllm_logger.removeHandler(keep)
    assert seen == ["KVBM: seen by vLLM's handlers"]


def test_connector_logs_reach_vllms_handlers_once_each(monkeypatch):
    """Records of vllm_kvbm reach the handlers of vLLM's non-propagating
    logger, and a handler attached there and to the root gets each once."""
    import logging

    from vllm_kvbm.plugin import _ToVllmHandlers

    class Keep(logging.Handler):
        def __init__(self):
            super().__init__()
            self.records = []

        def emit(self, record):
            self.records.append(record)

    vllm_only, shared = Keep(), Keep()
    vllm, root, ours = (logging.getLogger(n) for n in ("vllm", "", "vllm_kvbm"))
    monkeypatch.setattr(vllm, "propagate", False)
    monkeypatch.setattr(vllm, "handlers", [vllm_only, shared])
    monkeypatch.setattr(root, "handlers", root.handlers + [shared])
    monkeypatch.setattr(ours, "handlers", [_ToVllmHandlers()])
    monkeypatch.setattr(ours, "level", logging.INFO)
    logging.getLogger("vllm_kvbm.test").info("tier sizes")
    assert [r.getMessage() for r in vllm_only.records] == ["tier sizes"]
    assert [r.getMessage() for r in shared.records] == ["tier sizes"]
