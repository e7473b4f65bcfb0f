"""vllm_kvbm.config: Dynamo's DYN_KVBM_* variables, each read as the KVBM key
it means, and those not read named in a warning."""

from __future__ import annotations

import pytest

from test_config import _err, load
from vllm_kvbm.config import KVBMConfig


# ---- Dynamo's DYN_KVBM_* variables ---------------------------------------------

# Every DYN_KVBM_* variable read, with a value and the setting it must produce.
DYNAMO_ENV = {
    "DYN_KVBM_CPU_CACHE_GB": ("2", "host_cache_bytes", 2 * 10**9),
    "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": ("7", "host_cache_blocks", 7),
    "DYN_KVBM_DISK_CACHE_DIR": (None, "disk_cache_dir", None),  # tmp_path, below
    "DYN_KVBM_DISK_CACHE_GB": ("3", "disk_cache_bytes", 3 * 10**9),
    "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": ("false", "disk_admission", "frequency"),
    "DYN_KVBM_METRICS": ("true", "metrics_port", 6880),
    "DYN_KVBM_METRICS_PORT": ("6990", "metrics_port", 6990),
}


def test_dynamo_table_covers_every_dynamo_variable_read():
    from vllm_kvbm.config import _ENV

    read = {name for name in _ENV if name.startswith("DYN_")} | {"DYN_KVBM_METRICS"}
    assert read == set(DYNAMO_ENV)


@pytest.mark.parametrize("env", sorted(DYNAMO_ENV))
def test_each_dynamo_variable_sets_its_key(env, tmp_path):
    value, field, expected = DYNAMO_ENV[env]
    if env == "DYN_KVBM_DISK_CACHE_DIR":
        value = expected = str(tmp_path)
    cfg = load(None, **{env: value})
    assert getattr(cfg, field) == expected
    assert getattr(KVBMConfig(), field) != expected  # not the default by chance


def test_configuration_doc_lists_every_dynamo_variable_read():
    import re

    from helpers import ROOT

    doc = (ROOT / "docs" / "configuration.md").read_text()
    section = doc[doc.index("## Dynamo's variables") :]
    section = section[: section.index("\n## ")]
    accepted = section[: section.index("Not read")]
    assert set(re.findall(r"`(DYN_KVBM_\w+)`", accepted)) == set(DYNAMO_ENV)
    for name in (
        "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS",
        "DYN_KVBM_CACHE_STATS_MAX_REQUESTS",
        "DYN_KVBM_HOST_OFFLOAD_PREFIX_MIN_PRIORITY",
    ):
        assert name in section[len(accepted) :], name


@pytest.mark.parametrize(
    "value,want",
    [("true", "always"), ("1", "always"), ("false", "frequency"), ("off", "frequency")],
)
def test_dynamo_disk_offload_filter_is_frequency_admission(value, want):
    cfg = load(None, DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER=value)
    assert cfg.disk_admission == want
    assert cfg.disk_admission_min_uses == 2  # Dynamo: written to disk on the second use


def test_bad_dynamo_disk_offload_filter_names_the_variable_and_the_fix():
    msg = _err(None, DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER="sometimes")
    assert msg.startswith("DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER (sets disk_admission)"), msg
    assert "expected true" in msg and "'sometimes'" in msg


@pytest.mark.parametrize(
    "extra,env,port",
    [
        (None, {"DYN_KVBM_METRICS": "true"}, 6880),  # Dynamo's default port
        (None, {"DYN_KVBM_METRICS": "1", "DYN_KVBM_METRICS_PORT": "7001"}, 7001),
        (None, {"DYN_KVBM_METRICS_PORT": "7001"}, 7001),
        (None, {"DYN_KVBM_METRICS": "false", "DYN_KVBM_METRICS_PORT": "7001"}, None),
        (None, {"DYN_KVBM_METRICS": "false", "KVBM_METRICS_PORT": "7002"}, 7002),
        ({"metrics_port": 7003}, {"DYN_KVBM_METRICS": "true"}, 7003),
        ({"metrics_port": 7003}, {"DYN_KVBM_METRICS": "false"}, 7003),
        (None, {"DYN_KVBM_METRICS": "  "}, None),
    ],
)
def test_dynamo_metrics_switch(extra, env, port):
    assert load(extra, **env).metrics_port == port


def test_bad_dynamo_metrics_switch_names_the_variable_and_the_fix():
    msg = _err(None, DYN_KVBM_METRICS="please", DYN_KVBM_METRICS_PORT="7001")
    assert msg.startswith("DYN_KVBM_METRICS (turns metrics_port on): expected true or false"), msg
    assert "'please'" in msg and "DYN_KVBM_METRICS_PORT" in msg
    msg = _err(None, DYN_KVBM_METRICS="true", DYN_KVBM_METRICS_PORT="http")
    assert msg.startswith("DYN_KVBM_METRICS_PORT (sets metrics_port: expected an integer"), msg


def test_unread_dynamo_variables_are_named_in_a_warning_never_their_values(caplog):
    env = {
        "DYN_KVBM_OBJECT_SECRET_KEY": "hunter2-secret",
        "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": "100",
        "DYN_KVBM_LEADER_ZMQ_HOST": "  ",  # blank: as good as unset
        "DYN_KVBM_CPU_CACHE_GB": "1",
        "DYN_KVBM_METRICS": "false",
    }
    with caplog.at_level("WARNING", logger="vllm_kvbm.config"):
        load(None, **env)
    [record] = caplog.records
    msg = record.getMessage()
    assert msg.startswith(
        "KVBM: DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS, "
        "DYN_KVBM_OBJECT_SECRET_KEY are Dynamo's and not read"
    ), msg
    assert "hunter2" not in caplog.text and "100" not in msg
    caplog.clear()
    with caplog.at_level("WARNING", logger="vllm_kvbm.config"):
        load(None, DYN_KVBM_CPU_CACHE_GB="1", DYN_KVBM_METRICS="true")
    assert not caplog.records
