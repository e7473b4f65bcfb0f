"""vllm_kvbm.config: where a setting comes from: its KVBM_* variable (every
key has one), one key set from two sources, and the startup listing."""

from __future__ import annotations

import pytest

from test_config import GiB, MiB, _err, load
from vllm_kvbm.config import KVBMConfig, config_keys


# ---- environment -------------------------------------------------------------


@pytest.mark.parametrize(
    "env,value,expected",
    [
        ("KVBM_HOST_CACHE_SIZE", "256MiB", 256 * MiB),
        ("KVBM_HOST_CACHE_GB", "2", 2 * 10**9),
        ("KVBM_HOST_CACHE_GB", "0.5", 5 * 10**8),
        ("DYN_KVBM_CPU_CACHE_GB", "3", 3 * 10**9),
    ],
)
def test_env_size(env, value, expected):
    cfg = load(None, **{env: value})
    assert cfg.host_cache_bytes == expected
    assert cfg.host_slots(MiB) == expected // MiB
    assert cfg.sources == {"host_cache_size": env}


def test_env_blocks():
    for env in ("KVBM_HOST_CACHE_BLOCKS", "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS"):
        cfg = load(None, **{env: " 33 "})
        assert cfg.host_cache_blocks == 33 and cfg.host_slots(1) == 33


# ---- one key from two sources ----------------------------------------------------


def test_a_size_from_four_sources_is_an_error_naming_two_of_them():
    # JSON 64GiB with three env variables used to give the last one's 1e9
    # bytes without a word.
    msg = _err(
        {"host_cache_size": "64GiB"},
        KVBM_HOST_CACHE_SIZE="8GiB",
        KVBM_HOST_CACHE_GB="2",
        DYN_KVBM_CPU_CACHE_GB="1",
    )
    assert msg.startswith("host_cache_size is set to two different values: "), msg
    assert f"{64 * GiB} bytes (64.00 GiB) by kv_connector_extra_config" in msg, msg
    assert f"{8 * GiB} bytes (8.00 GiB) by KVBM_HOST_CACHE_SIZE" in msg, msg
    assert "set it in one place only" in msg


@pytest.mark.parametrize(
    "extra,env",
    [
        ({"namespace": "a"}, {"KVBM_NAMESPACE": "b"}),
        ({"disk_admission": "always"}, {"DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "false"}),
        (None, {"KVBM_DISK_CACHE_SIZE": "1GiB", "DYN_KVBM_DISK_CACHE_GB": "1"}),
        ({"metrics_port": 7003}, {"DYN_KVBM_METRICS_PORT": "7004"}),
    ],
)
def test_two_sources_different_values_is_an_error_naming_both(extra, env):
    msg = _err(extra, **env)
    assert "is set to two different values" in msg, msg
    for env_name in env:
        assert env_name in msg or env_name == "KVBM_DISK_CACHE_SIZE", msg
    if extra:
        assert "by kv_connector_extra_config" in msg, msg


def test_two_sources_same_value_pass_with_a_log_line(caplog):
    with caplog.at_level("INFO", logger="vllm_kvbm.config"):
        cfg = load(
            {"host_cache_size": "8GiB", "nixl_backend": "UCX"},
            KVBM_HOST_CACHE_SIZE=str(8 * GiB),
            KVBM_NIXL_BACKEND="ucx",
            KVBM_NAMESPACE="b",
            KVBM_REMOTE_URL="  ",
        )
    assert (cfg.host_cache_bytes, cfg.nixl_backend, cfg.namespace) == (8 * GiB, "UCX", "b")
    assert cfg.remote_url is None  # blank: not set
    assert (
        "KVBM: host_cache_size is set to the same value by kv_connector_extra_config "
        "and KVBM_HOST_CACHE_SIZE"
    ) in caplog.text
    assert cfg.sources["host_cache_size"] == "kv_connector_extra_config and KVBM_HOST_CACHE_SIZE"


def test_host_cache_blocks_and_size_together_is_an_error_naming_both():
    msg = _err({"host_cache_blocks": 10}, KVBM_HOST_CACHE_GB="2")
    assert msg == (
        "host_cache_blocks (from kv_connector_extra_config) and host_cache_size "
        "(from KVBM_HOST_CACHE_GB) both size the host tier; set only one of them"
    )
    assert "both size the host tier" in _err(
        None, DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="5", KVBM_HOST_CACHE_SIZE="1GiB"
    )


def test_secret_files_from_two_sources_are_named_by_path_never_content(tmp_path):
    a, b = tmp_path / "a.secret", tmp_path / "b.secret"
    a.write_text("A" * 32 + "\n")
    b.write_text("B" * 32 + "\n")
    msg = _err({"page_secret_file": str(a)}, KVBM_PAGE_SECRET_FILE=str(b))
    assert repr(str(a)) in msg and repr(str(b)) in msg and "KVBM_PAGE_SECRET_FILE" in msg
    assert "AAAA" not in msg and "BBBB" not in msg
    # the same file (or the same bytes) twice is the same value
    assert load({"page_secret_file": str(a)}, KVBM_PAGE_SECRET_FILE=str(a)).page_secret


# ---- the startup listing ----------------------------------------------------------


def test_describe_lists_each_set_value_with_its_source_and_no_secret(tmp_path):
    secret = tmp_path / "page.secret"
    secret.write_text("s3cr3t-page-key-material-0123456789\n")
    cfg = load(
        {
            "host_cache_size": "16G",
            "remote_url": "redis://cache:6379",
            "page_secret_file": str(secret),
        },
        KVBM_DISK_ADMISSION_MIN_USES="3",
        KVBM_REMOTE_PASSWORD="hunter2-password",
        DYN_KVBM_METRICS="true",
    )
    line = cfg.describe()
    assert line == (
        f"disk_admission_min_uses=3 from KVBM_DISK_ADMISSION_MIN_USES; "
        f"host_cache_size={16 * GiB} bytes (16.00 GiB) from kv_connector_extra_config; "
        f"metrics_port=6880 from DYN_KVBM_METRICS; "
        f"page_secret_file=<set> from kv_connector_extra_config; "
        f"remote_url='redis://cache:6379' from kv_connector_extra_config; "
        f"remote_password=<set> from KVBM_REMOTE_PASSWORD"
    ), line
    assert "s3cr3t" not in line and "hunter2" not in line
    env_secret = load(None, KVBM_PAGE_SECRET="x" * 32).describe()
    assert env_secret == "page_secret=<set> from KVBM_PAGE_SECRET"
    assert load().describe() == "every key at its default"


# ---- every key has its environment variable -----------------------------------

# A value for each key, as env text, and the field value it must give.
ENV_EXAMPLES = {
    "host_cache_size": ("2Gi", "host_cache_bytes", 2 * GiB),
    "host_cache_blocks": ("12", "host_cache_blocks", 12),
    "host_copy_path": ("threads", "host_copy_path", "threads"),
    "page_tokens": ("512", "page_tokens", 512),
    "offload_decode_blocks": ("true", "offload_decode_blocks", True),
    "disk_cache_dir": (None, "disk_cache_dir", None),  # tmp_path
    "disk_cache_size": ("3GB", "disk_cache_bytes", 3 * 10**9),
    "disk_admission": ("frequency", "disk_admission", "frequency"),
    "disk_admission_min_uses": ("5", "disk_admission_min_uses", 5),
    "remote_url": ("redis://[::1]:6380/2", "remote_url", "redis://[::1]:6380/2"),
    "remote_timeout_s": ("0.5", "remote_timeout_s", 0.5),
    "tier_write_queue_pages": ("9", "tier_write_queue_pages", 9),
    "tier_read_timeout_s": ("4", "tier_read_timeout_s", 4.0),
    "remote_password_file": (None, "remote_password", None),  # a file, below
    "remote_tls_ca_file": (None, "remote_tls_ca_file", None),  # a file, below
    "metrics_port": ("7100", "metrics_port", 7100),
    "metrics_host": ("0.0.0.0", "metrics_host", "0.0.0.0"),
    "nixl_backend": ("ucx", "nixl_backend", "UCX"),
    "namespace": ("tenant-b", "namespace", "tenant-b"),
    "page_secret_file": (None, "page_secret", None),  # a file, below
    "load_split": ("false", "load_split", False),
    "pool_cache_size": ("8GiB", "pool_cache_bytes", 8 * GiB),
    "pool_dir": (None, "pool_dir", None),  # tmp_path
    "pool_socket": ("/run/kvbm/pool.sock", "pool_socket", "/run/kvbm/pool.sock"),
    "pool_serve_port": ("7200", "pool_serve_port", 7200),
    "pool_serve_host": ("10.0.0.5", "pool_serve_host", "10.0.0.5"),
    "peer_read_timeout_s": ("0.5", "peer_read_timeout_s", 0.5),
    "peer_reads": ("true", "peer_reads", True),
    "peer_directory_url": (
        "redis://dir.example:6379/1",
        "peer_directory_url",
        "redis://dir.example:6379/1",
    ),
    "peer_directory_ttl_s": ("60", "peer_directory_ttl_s", 60.0),
}


@pytest.mark.parametrize("key", config_keys())
def test_every_key_has_its_env_variable_and_it_parses(key, tmp_path):
    from vllm_kvbm.config import _ENV

    env = "KVBM_" + key.upper()
    assert _ENV.get(env, (None,))[0] == key, f"{key} has no environment variable {env}"
    text, field, expected = ENV_EXAMPLES[key]
    extra = {}
    if key in ("disk_cache_dir", "pool_dir"):
        text = expected = str(tmp_path)
    elif key.endswith("_file"):
        path = tmp_path / key
        path.write_text(
            "-----BEGIN CERTIFICATE-----\n" if key == "remote_tls_ca_file" else "p" * 32 + "\n"
        )
        text = str(path)
        extra = {
            "remote_url": ("rediss://h:6379" if key == "remote_tls_ca_file" else "redis://h:6379")
        }
    if key.startswith("pool_") and key != "pool_cache_size":
        extra = {"pool_cache_size": "1GiB"}  # the pool's other keys need a pool
    if key.startswith("peer_directory"):  # a directory needs a reader (or a served pool)
        extra = {"peer_reads": True}
        if key != "peer_directory_url":
            extra["peer_directory_url"] = "redis://h:1"
    cfg = load(extra, **{env: text})
    got = getattr(cfg, field)
    if key.endswith("_file"):
        assert got is not None and env in cfg.describe()
    else:
        assert got == expected
        # UCX is the one backend accepted: its example is its default
        assert got != getattr(KVBMConfig(), field) or key == "nixl_backend"
    assert cfg.sources[key] == env


def test_env_examples_cover_every_key():
    assert sorted(ENV_EXAMPLES) == config_keys()


@pytest.mark.parametrize(
    "env,value,fragments",
    [
        ("KVBM_HOST_CACHE_SIZE", "big", ["KVBM_HOST_CACHE_SIZE", "host_cache_size", "'big'"]),
        ("KVBM_HOST_CACHE_GB", "two", ["KVBM_HOST_CACHE_GB", "host_cache_size"]),
        ("DYN_KVBM_CPU_CACHE_GB", "-1", ["DYN_KVBM_CPU_CACHE_GB", "host_cache_size"]),
        ("KVBM_HOST_CACHE_BLOCKS", "0", ["KVBM_HOST_CACHE_BLOCKS", "host_cache_blocks", ">= 1"]),
        (
            "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS",
            "many",
            ["DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "host_cache_blocks", "integer"],
        ),
        ("KVBM_NIXL_BACKEND", "rdma", ["KVBM_NIXL_BACKEND", "nixl_backend", '"UCX"']),
    ],
)
def test_bad_env_value_names_env_var(env, value, fragments):
    msg = _err({"host_cache_size": "1GiB"}, **{env: value})
    assert msg.startswith(env), msg
    for frag in fragments:
        assert frag in msg, (frag, msg)


def test_bad_extra_value_does_not_blame_env():
    msg = _err({"host_cache_size": "big"}, KVBM_NAMESPACE="x")
    assert msg.startswith("host_cache_size:") and "KVBM_" not in msg
