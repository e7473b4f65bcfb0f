"""A bad KVBM setting stops the start where vLLM builds its config (the
API server of `vllm serve`, the process that makes an LLM), before an engine
core starts; tests/e2e/test_serve.py sees it through a real `vllm serve`."""

from __future__ import annotations

import pytest

from helpers.scheduler_harness import _model_dir
from vllm_kvbm.config import KVBMConfigError
from vllm_kvbm.startup_check import check_engine_config, kvbm_extra_configs


def _kv(**fields):
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_role="kv_both", **fields)


def test_the_kvbm_settings_are_found_directly_by_module_path_and_in_a_multiconnector():
    bad = {"host_cache_sise": "1GiB"}
    assert list(
        kvbm_extra_configs(_kv(kv_connector="KVBMConnector", kv_connector_extra_config=bad))
    ) == [bad]
    assert list(
        kvbm_extra_configs(
            _kv(
                kv_connector="Renamed",
                kv_connector_module_path="vllm_kvbm.connector",
                kv_connector_extra_config=bad,
            )
        )
    ) == [bad]
    multi = _kv(
        kv_connector="MultiConnector",
        kv_connector_extra_config={
            "connectors": [
                {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
                {
                    "kv_connector": "KVBMConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": bad,
                },
            ]
        },
    )
    assert list(kvbm_extra_configs(multi)) == [bad]
    assert list(kvbm_extra_configs(_kv(kv_connector="NixlConnector"))) == []
    assert list(kvbm_extra_configs(None)) == []


def _engine_args(extra: dict):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=_model_dir(),
        skip_tokenizer_init=True,
        block_size=128,
        max_model_len=4096,
        dtype="float32",
        kv_transfer_config=_kv(kv_connector="KVBMConnector", kv_connector_extra_config=extra),
    )


def test_vllms_config_builder_refuses_a_bad_key_once_the_plugin_is_registered():
    """The plugin's register() (vLLM calls it in every process it starts)
    wraps EngineArgs.create_engine_config; a good config still builds."""
    from vllm_kvbm import plugin

    plugin.register()
    with pytest.raises(KVBMConfigError) as err:
        _engine_args({"host_cache_sise": "1GiB"}).create_engine_config()
    assert "unknown key 'host_cache_sise'" in str(err.value)
    assert "did you mean 'host_cache_size'" in str(err.value)
    config = _engine_args({"host_cache_size": "1GiB"}).create_engine_config()
    assert config.kv_transfer_config.kv_connector_extra_config == {"host_cache_size": "1GiB"}


def test_an_api_server_without_local_engines_leaves_the_check_to_them(tmp_path):
    """Headless engines on other nodes: their directories are not this one's."""
    from types import SimpleNamespace

    missing = str(tmp_path / "nowhere")
    kv = _kv(kv_connector="KVBMConnector", kv_connector_extra_config={"disk_cache_dir": missing})
    here = SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_size_local=1), kv_transfer_config=kv
    )
    with pytest.raises(KVBMConfigError, match="disk_cache_dir"):
        check_engine_config(here)
    here.parallel_config.data_parallel_size_local = 0
    check_engine_config(here)


def test_the_check_warns_nothing_the_engine_core_will_warn_again(caplog, monkeypatch):
    import logging
    from types import SimpleNamespace

    # Set twice to the same value: the engine core says so once, at INFO.
    monkeypatch.setenv("KVBM_HOST_CACHE_SIZE", "1GiB")
    kv = _kv(kv_connector="KVBMConnector", kv_connector_extra_config={"host_cache_size": "1GiB"})
    with caplog.at_level(logging.INFO, logger="vllm_kvbm"):
        check_engine_config(SimpleNamespace(kv_transfer_config=kv))
    assert not [r for r in caplog.records if r.name.startswith("vllm_kvbm")]
    assert not logging.getLogger("vllm_kvbm.config").disabled
