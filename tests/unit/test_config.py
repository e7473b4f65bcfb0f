"""vllm_kvbm.config: parsing, validation messages, env overrides."""

from __future__ import annotations

import pytest

from vllm_kvbm.config import KVBMConfig, KVBMConfigError, config_keys, load_config, parse_size

GiB, MiB = 1024**3, 1024**2


def load(extra=None, **env):
    return load_config(extra, environ=env)


@pytest.mark.parametrize("text,expected", [
    ("4GiB", 4 * GiB),
    ("512MiB", 512 * MiB),
    ("1.5 GiB", int(1.5 * GiB)),
    ("8GB", 8 * 10**9),
    ("8gb", 8 * 10**9),
    ("  64 KiB ", 64 * 1024),
    ("1048576", MiB),
    ("100B", 100),
    ("2k", 2000),
    ("1TiB", 1024**4),
    # vLLM's human sizes (--kv-cache-memory-bytes): upper-case letters are
    # binary, lower-case decimal; Gi/GiB binary and GB decimal in any case
    ("16G", 16 * GiB),
    ("16Gi", 16 * GiB),
    ("16gi", 16 * GiB),
    ("16GiB", 16 * GiB),
    ("16g", 16 * 10**9),
    ("16GB", 16 * 10**9),
    ("16Gb", 16 * 10**9),
    ("2K", 2048),
    ("3M", 3 * MiB),
    ("1T", 1024**4),
    ("512Mi", 512 * MiB),
    ("1.5G", int(1.5 * GiB)),
    (1234567, 1234567),
    (0, 0),
    (2**60 + 1, 2**60 + 1),  # exact, no float rounding
    (1.5e7, 15 * 10**6),
])
def test_parse_size(text, expected):
    assert parse_size("host_cache_size", text) == expected


def test_size_from_extra_config():
    assert load({"host_cache_size": "512MiB"}).host_cache_bytes == 512 * MiB
    assert load({"host_cache_size": 2 * GiB}).host_cache_bytes == 2 * GiB


def test_defaults():
    cfg = load()
    assert cfg == KVBMConfig()
    assert cfg.host_cache_bytes == 4 * GiB and cfg.host_cache_blocks is None
    assert cfg.nixl_backend == "UCX" and cfg.namespace == ""
    assert cfg.metrics_host == "127.0.0.1"  # a metrics port is opened on purpose only
    assert config_keys() == ["disk_admission", "disk_admission_min_uses", "disk_cache_dir",
                             "disk_cache_size", "host_cache_blocks", "host_cache_size",
                             "load_split", "metrics_host", "metrics_port", "namespace", "nixl_backend",
                             "offload_decode_blocks", "page_secret_file", "page_tokens",
                             "peer_directory_ttl_s", "peer_directory_url",
                             "peer_read_timeout_s", "peer_reads", "pool_cache_size", "pool_dir",
                             "pool_serve_host", "pool_serve_port", "pool_socket",
                             "remote_password_file",
                             "remote_timeout_s", "remote_tls_ca_file", "remote_url",
                             "tier_read_timeout_s", "tier_write_queue_pages"]


def _err(extra, **env) -> str:
    with pytest.raises(KVBMConfigError) as info:
        load(extra, **env)
    return str(info.value)


def test_unknown_key_did_you_mean():
    msg = _err({"host_cache_sise": "1GiB"})
    assert "unknown key 'host_cache_sise'" in msg
    assert "did you mean 'host_cache_size'?" in msg
    assert "Valid keys: disk_admission, disk_admission_min_uses, disk_cache_dir" in msg
    msg = _err({"zzz": 1})
    assert "unknown key 'zzz'" in msg and "did you mean" not in msg and "Valid keys" in msg


@pytest.mark.parametrize("value,fragments", [
    ("lots", ["host_cache_size", "cannot read 'lots'", "\"16GiB\"", "\"16GB\""]),
    ("4 Gigs", ["host_cache_size", "unknown unit 'Gigs'", "\"16Gi\"", "\"16G\"",
                "1024-based", "1000-based"]),
    ("4Gg", ["host_cache_size", "unknown unit 'Gg'"]),
    ("4GiBs", ["host_cache_size", "unknown unit"]),
    ("-1GiB", ["host_cache_size", "cannot read '-1GiB'"]),
    (-5, ["host_cache_size", "must not be negative"]),
    (-0.5, ["host_cache_size", "must not be negative"]),
    (True, ["host_cache_size", "expected a size", "True"]),
    (None, ["host_cache_size", "cannot read None"]),
    ([4], ["host_cache_size", "cannot read [4]"]),
    (float("nan"), ["host_cache_size", "finite"]),
    (float("inf"), ["host_cache_size", "finite"]),
    ("", ["host_cache_size", "cannot read ''"]),
    # no unit, under 1 MiB: what vLLM and LMCache would read as GiB
    (16, ["host_cache_size: 16 has no unit", "\"16GiB\"", "--kv-offloading-size 16"]),
    ("16", ["host_cache_size: '16' has no unit", "\"16GiB\"", "at least 1048576"]),
    (0.5, ["host_cache_size: 0.5 has no unit", "\"0.5GiB\""]),
    ("1048575", ["has no unit"]),
])
def test_bad_sizes(value, fragments):
    msg = _err({"host_cache_size": value})
    for frag in fragments:
        assert frag in msg, (frag, msg)


@pytest.mark.parametrize("value,fragment", [
    (0, "must be >= 1, got 0"),
    (-3, "must be >= 1, got -3"),
    ("x", "expected an integer, got 'x'"),
    ("1.5", "expected an integer, got '1.5'"),
    (2.0, "expected an integer, got 2.0"),
    (True, "expected an integer, got True"),
])
def test_bad_host_cache_blocks(value, fragment):
    msg = _err({"host_cache_blocks": value})
    assert msg.startswith("host_cache_blocks: ") and fragment in msg


def test_host_cache_blocks_ok():
    assert load({"host_cache_blocks": 7}).host_cache_blocks == 7
    assert load({"host_cache_blocks": "12"}).host_cache_blocks == 12


def test_nixl_backend():
    assert load({"nixl_backend": "ucx"}).nixl_backend == "UCX"
    assert load({"nixl_backend": "UCX"}).nixl_backend == "UCX"
    msg = _err({"nixl_backend": "foo"})
    assert "nixl_backend" in msg and "'foo'" in msg and '"UCX"' in msg
    assert "nixl_backend" in _err({"nixl_backend": 3})


@pytest.mark.parametrize("backend", ["POSIX", "posix", "GDS", "OBJ"])
def test_nixl_storage_backend_cannot_move_kv_is_a_startup_error(backend):
    # POSIX and GDS move DRAM/VRAM <-> FILE, OBJ to object stores: none copies
    # the engine's KV blocks into the host tier (the worker's NIXL agent would
    # fail every transfer, or worse), so startup stops naming the key and fix.
    msg = _err({"nixl_backend": backend})
    assert msg.startswith("nixl_backend: ") and repr(backend) in msg, msg
    assert "storage backend" in msg and 'Set nixl_backend to "UCX"' in msg, msg
    msg = _err(None, KVBM_NIXL_BACKEND=backend)
    assert msg.startswith("KVBM_NIXL_BACKEND") and "storage backend" in msg, msg


def test_namespace():
    assert load({"namespace": "tenant-a"}).namespace == "tenant-a"
    for bad in (5, None, ["a"]):
        msg = _err({"namespace": bad})
        assert msg.startswith("namespace: expected a string"), msg


# ---- environment -------------------------------------------------------------

@pytest.mark.parametrize("env,value,expected", [
    ("KVBM_HOST_CACHE_SIZE", "256MiB", 256 * MiB),
    ("KVBM_HOST_CACHE_GB", "2", 2 * 10**9),
    ("KVBM_HOST_CACHE_GB", "0.5", 5 * 10**8),
    ("DYN_KVBM_CPU_CACHE_GB", "3", 3 * 10**9),
])
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
    msg = _err({"host_cache_size": "64GiB"}, KVBM_HOST_CACHE_SIZE="8GiB",
               KVBM_HOST_CACHE_GB="2", DYN_KVBM_CPU_CACHE_GB="1")
    assert msg.startswith("host_cache_size is set to two different values: "), msg
    assert f"{64 * GiB} bytes (64.00 GiB) by kv_connector_extra_config" in msg, msg
    assert f"{8 * GiB} bytes (8.00 GiB) by KVBM_HOST_CACHE_SIZE" in msg, msg
    assert "set it in one place only" in msg


@pytest.mark.parametrize("extra,env", [
    ({"namespace": "a"}, {"KVBM_NAMESPACE": "b"}),
    ({"disk_admission": "always"}, {"DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "false"}),
    (None, {"KVBM_DISK_CACHE_SIZE": "1GiB", "DYN_KVBM_DISK_CACHE_GB": "1"}),
    ({"metrics_port": 7003}, {"DYN_KVBM_METRICS_PORT": "7004"}),
])
def test_two_sources_different_values_is_an_error_naming_both(extra, env):
    msg = _err(extra, **env)
    assert "is set to two different values" in msg, msg
    for env_name in env:
        assert env_name in msg or env_name == "KVBM_DISK_CACHE_SIZE", msg
    if extra:
        assert "by kv_connector_extra_config" in msg, msg


def test_two_sources_same_value_pass_with_a_log_line(caplog):
    with caplog.at_level("INFO", logger="vllm_kvbm.config"):
        cfg = load({"host_cache_size": "8GiB", "nixl_backend": "UCX"},
                   KVBM_HOST_CACHE_SIZE=str(8 * GiB), KVBM_NIXL_BACKEND="ucx",
                   KVBM_NAMESPACE="b", KVBM_REMOTE_URL="  ")
    assert (cfg.host_cache_bytes, cfg.nixl_backend, cfg.namespace) == (8 * GiB, "UCX", "b")
    assert cfg.remote_url is None  # blank: not set
    assert ("KVBM: host_cache_size is set to the same value by kv_connector_extra_config "
            "and KVBM_HOST_CACHE_SIZE") in caplog.text
    assert cfg.sources["host_cache_size"] == "kv_connector_extra_config and KVBM_HOST_CACHE_SIZE"


def test_host_cache_blocks_and_size_together_is_an_error_naming_both():
    msg = _err({"host_cache_blocks": 10}, KVBM_HOST_CACHE_GB="2")
    assert msg == ("host_cache_blocks (from kv_connector_extra_config) and host_cache_size "
                   "(from KVBM_HOST_CACHE_GB) both size the host tier; set only one of them")
    assert "both size the host tier" in _err(
        None, DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS="5", KVBM_HOST_CACHE_SIZE="1GiB")


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
    cfg = load({"host_cache_size": "16G", "remote_url": "redis://cache:6379",
                "page_secret_file": str(secret)},
               KVBM_DISK_ADMISSION_MIN_USES="3", KVBM_REMOTE_PASSWORD="hunter2-password",
               DYN_KVBM_METRICS="true")
    line = cfg.describe()
    assert line == (
        f"disk_admission_min_uses=3 from KVBM_DISK_ADMISSION_MIN_USES; "
        f"host_cache_size={16 * GiB} bytes (16.00 GiB) from kv_connector_extra_config; "
        f"metrics_port=6880 from DYN_KVBM_METRICS; "
        f"page_secret_file=<set> from kv_connector_extra_config; "
        f"remote_url='redis://cache:6379' from kv_connector_extra_config; "
        f"remote_password=<set> from KVBM_REMOTE_PASSWORD"), line
    assert "s3cr3t" not in line and "hunter2" not in line
    env_secret = load(None, KVBM_PAGE_SECRET="x" * 32).describe()
    assert env_secret == "page_secret=<set> from KVBM_PAGE_SECRET"
    assert load().describe() == "every key at its default"


# ---- every key has its environment variable -----------------------------------

# A value for each key, as env text, and the field value it must give.
ENV_EXAMPLES = {
    "host_cache_size": ("2Gi", "host_cache_bytes", 2 * GiB),
    "host_cache_blocks": ("12", "host_cache_blocks", 12),
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
    "peer_directory_url": ("redis://dir.example:6379/1", "peer_directory_url",
                           "redis://dir.example:6379/1"),
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
        path.write_text("-----BEGIN CERTIFICATE-----\n" if key == "remote_tls_ca_file"
                        else "p" * 32 + "\n")
        text = str(path)
        extra = {"remote_url": ("rediss://h:6379" if key == "remote_tls_ca_file"
                                else "redis://h:6379")}
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


@pytest.mark.parametrize("env,value,fragments", [
    ("KVBM_HOST_CACHE_SIZE", "big", ["KVBM_HOST_CACHE_SIZE", "host_cache_size", "'big'"]),
    ("KVBM_HOST_CACHE_GB", "two", ["KVBM_HOST_CACHE_GB", "host_cache_size"]),
    ("DYN_KVBM_CPU_CACHE_GB", "-1", ["DYN_KVBM_CPU_CACHE_GB", "host_cache_size"]),
    ("KVBM_HOST_CACHE_BLOCKS", "0", ["KVBM_HOST_CACHE_BLOCKS", "host_cache_blocks", ">= 1"]),
    ("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "many",
     ["DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "host_cache_blocks", "integer"]),
    ("KVBM_NIXL_BACKEND", "rdma", ["KVBM_NIXL_BACKEND", "nixl_backend", '"UCX"']),
])
def test_bad_env_value_names_env_var(env, value, fragments):
    msg = _err({"host_cache_size": "1GiB"}, **{env: value})
    assert msg.startswith(env), msg
    for frag in fragments:
        assert frag in msg, (frag, msg)


def test_bad_extra_value_does_not_blame_env():
    msg = _err({"host_cache_size": "big"}, KVBM_NAMESPACE="x")
    assert msg.startswith("host_cache_size:") and "KVBM_" not in msg


# ---- host_slots ------------------------------------------------------------

def test_host_slots():
    assert KVBMConfig(host_cache_bytes=10 * MiB).host_slots(MiB) == 10
    assert KVBMConfig(host_cache_bytes=10 * MiB + MiB - 1).host_slots(MiB) == 10
    assert KVBMConfig(host_cache_bytes=1, host_cache_blocks=3).host_slots(MiB) == 3
    # pages of several blocks: host_cache_blocks counts blocks, slots are pages
    assert KVBMConfig(host_cache_bytes=1, host_cache_blocks=9).host_slots(4 * MiB, 4) == 2
    assert KVBMConfig(host_cache_bytes=10 * MiB).host_slots(4 * MiB, 4) == 2


def test_host_cache_blocks_under_one_page_names_both_fields():
    with pytest.raises(KVBMConfigError) as info:
        load({"host_cache_blocks": 3}).host_slots(MiB, 4)
    msg = str(info.value)
    assert msg.startswith("host_cache_blocks:") and "page_tokens" in msg


def test_page_tokens_parses_and_refuses_zero():
    assert load({"page_tokens": "256"}).page_tokens == 256
    assert load({}).page_tokens is None
    with pytest.raises(KVBMConfigError, match="page_tokens"):
        load({"page_tokens": 0})


def test_host_slots_too_small_names_key_and_fix():
    block = 3 * MiB
    with pytest.raises(KVBMConfigError) as info:
        load({"host_cache_size": "2MiB"}).host_slots(block)
    msg = str(info.value)
    assert msg.startswith("host_cache_size:")
    assert f"{2 * MiB} bytes cannot hold one KV page" in msg
    assert f"set host_cache_size to at least {block} bytes" in msg
    assert "\"192MiB\" for 64 pages" in msg
    with pytest.raises(KVBMConfigError, match="host_cache_size"):
        load({"host_cache_size": 0}).host_slots(1)


@pytest.mark.parametrize("raw,want", [(True, True), ("yes", True), ("0", False), ("off", False)])
def test_offload_decode_blocks_parses_booleans(raw, want):
    assert load_config({"offload_decode_blocks": raw}).offload_decode_blocks is want


def test_offload_decode_blocks_rejects_other_text():
    with pytest.raises(KVBMConfigError, match="offload_decode_blocks: expected true or false"):
        load_config({"offload_decode_blocks": "sometimes"})
    with pytest.raises(KVBMConfigError, match="KVBM_OFFLOAD_DECODE_BLOCKS"):
        load_config({}, {"KVBM_OFFLOAD_DECODE_BLOCKS": "maybe"})


def test_metrics_port_validation():
    assert load_config({"metrics_port": "6880"}).metrics_port == 6880
    assert load_config({}, {"DYN_KVBM_METRICS_PORT": "6881"}).metrics_port == 6881
    with pytest.raises(KVBMConfigError, match="metrics_port: 70000 is not a TCP port"):
        load_config({"metrics_port": 70000})
    with pytest.raises(KVBMConfigError, match="metrics_port: expected an integer"):
        load_config({"metrics_port": "http"})


def test_disk_cache_dir_must_exist_and_be_writable(tmp_path):
    assert load_config({"disk_cache_dir": str(tmp_path)}).disk_cache_dir == str(tmp_path)
    missing = tmp_path / "nope"
    with pytest.raises(KVBMConfigError, match=r"disk_cache_dir: directory .* does not exist; "
                                              r"create it \(mkdir -p"):
        load_config({"disk_cache_dir": str(missing)})
    with pytest.raises(KVBMConfigError, match="KVBM_DISK_CACHE_DIR"):
        load_config({}, {"KVBM_DISK_CACHE_DIR": str(missing)})


def test_disk_tier_too_small_for_one_block(tmp_path):
    cfg = load_config({"disk_cache_dir": str(tmp_path), "disk_cache_size": "1MiB"})
    with pytest.raises(KVBMConfigError, match="disk_cache_size: .* cannot hold one KV page"):
        cfg.disk_blocks(2 << 20)
    assert load_config({"disk_cache_dir": str(tmp_path),
                        "disk_cache_size": "1GiB"}).disk_blocks(2 << 20) > 400


@pytest.mark.parametrize("url", ["http://127.0.0.1:1234", "lm://host", "lm://h:0", "redis://h:0",
                                 "resp://h:1", "redis+cluster://a:1/1", "redis://h:1/x",
                                 "rediss://h:1?ssl_cert_reqs=none", "valkey://a b:1"])
def test_remote_url_must_be_an_lmcache_or_redis_server(url):
    with pytest.raises(KVBMConfigError, match=r'remote_url: .* write it as "lm://HOST:PORT"'):
        load_config({"remote_url": url})


@pytest.mark.parametrize("url,scheme,nodes,tls,cluster,db,user", [
    ("lm://h:65432", "lm", [("h", 65432)], False, False, 0, None),
    ("redis://cache.local", "redis", [("cache.local", 6379)], False, False, 0, None),
    ("rediss://kvbm@10.0.0.5:6380/3", "rediss", [("10.0.0.5", 6380)], True, False, 3, "kvbm"),
    ("valkey://[::1]:7000", "valkey", [("::1", 7000)], False, False, 0, None),
    ("valkeys://v:1/0", "valkeys", [("v", 1)], True, False, 0, None),
    ("redis+cluster://a:7000,b:7001,c", "redis", [("a", 7000), ("b", 7001), ("c", 6379)],
     False, True, 0, None),
    ("rediss+cluster://u@a:1", "rediss", [("a", 1)], True, True, 0, "u"),
])
def test_remote_url_forms(url, scheme, nodes, tls, cluster, db, user):
    from vllm_kvbm.config import parse_remote_url

    assert load_config({"remote_url": url}).remote_url == url
    t = parse_remote_url("remote_url", url)
    assert (t.scheme, list(t.nodes), t.tls, t.cluster, t.db, t.username) == \
        (scheme, nodes, tls, cluster, db, user)
    assert t.resp == (scheme != "lm")
    assert parse_remote_url("remote_url", str(t)) == t  # the logged form reads back the same


@pytest.mark.parametrize("url", ["redis://[::1", "redis://[zz::1]:1", "redis://::1:6379",
                                 "redis://h\n:1", "redis://h:1:2", "redis://h:", "lm://[::1]",
                                 "lm://h:1?x", "lm://h:1/", "lm://[::1]:70000",
                                 "redis://u@:1", "redis://[::1]:6379?db=1"])
def test_malformed_hosts_and_ports_are_refused(url):
    with pytest.raises(KVBMConfigError, match=r'remote_url: .* write it as "lm://HOST:PORT"'):
        load_config({"remote_url": url})


def test_ipv6_urls_parse():
    from vllm_kvbm.config import parse_lm_url, parse_remote_url

    assert parse_lm_url("remote_url", "lm://[::1]:65432") == ("::1", 65432)
    assert parse_remote_url("remote_url", "lm://[::1]:65432").nodes == (("::1", 65432),)
    t = parse_remote_url("remote_url", "redis://[::1]:6379/0")
    assert (t.scheme, t.nodes, t.db) == ("redis", (("::1", 6379),), 0)
    t = parse_remote_url("remote_url", "redis+cluster://[fd00::1]:7000,[fd00::2],h:7002")
    assert t.nodes == (("fd00::1", 7000), ("fd00::2", 6379), ("h", 7002))
    assert str(t) == "redis+cluster://[fd00::1]:7000,[fd00::2]:6379,h:7002"
    assert load_config({"remote_url": "redis://[::1]:6379/0"}, {}).remote_url \
        == "redis://[::1]:6379/0"


def test_lm_url_with_an_ipv6_address_names_why_it_cannot_work():
    # LMCache's server and client sockets are AF_INET: the URL reads, but no
    # connection could ever be made, so startup says so.
    msg = _err({"remote_url": "lm://[::1]:65432"})
    assert msg.startswith("remote_url: 'lm://[::1]:65432' names an IPv6 address"), msg
    assert "IPv4" in msg and "redis://" in msg


def test_remote_password_file_and_env(tmp_path):
    pw = tmp_path / "pw"
    pw.write_text("s3cret-pw\n")
    cfg = load({"remote_url": "redis://h:1", "remote_password_file": str(pw)})
    assert cfg.remote_password.reveal() == "s3cret-pw"
    assert "s3cret" not in repr(cfg) and "s3cret" not in repr(cfg.remote_password)
    assert load({"remote_url": "redis://h:1"}, KVBM_REMOTE_PASSWORD_FILE=str(pw)) == cfg
    assert load({"remote_url": "redis://h:1"},
                KVBM_REMOTE_PASSWORD="env-pw").remote_password.reveal() == "env-pw"
    msg = _err({"remote_url": "redis://h:1", "remote_password_file": str(pw)},
               KVBM_REMOTE_PASSWORD="env-pw")
    assert "both set" in msg and "env-pw" not in msg and "s3cret" not in msg
    msg = _err({"remote_url": "lm://h:1", "remote_password_file": str(pw)})
    assert msg.startswith("remote_password_file: ") and "s3cret" not in msg
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "two").write_text("a\nb\n")
    for bad in ("empty", "two"):
        msg = _err({"remote_password_file": str(tmp_path / bad)})
        assert msg.startswith("remote_password_file: ") and "one password" in msg


def test_remote_tls_ca_file_needs_a_tls_url(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    assert load({"remote_url": "rediss://h:1", "remote_tls_ca_file": str(ca)}) \
        .remote_tls_ca_file == str(ca)
    assert load({"remote_url": "valkeys+cluster://h:1"},
                KVBM_REMOTE_TLS_CA_FILE=str(ca)).remote_tls_ca_file == str(ca)
    for url in ("redis://h:1", "lm://h:1"):
        msg = _err({"remote_url": url, "remote_tls_ca_file": str(ca)})
        assert msg.startswith("remote_tls_ca_file: ") and "rediss://" in msg, msg
    msg = _err({"remote_url": "redis://h:1"}, KVBM_REMOTE_TLS_CA_FILE=str(ca))
    assert msg.startswith("KVBM_REMOTE_TLS_CA_FILE (sets remote_tls_ca_file): "), msg


def test_peer_directory_needs_an_engine_that_reads_or_writes_it(tmp_path):
    url = "redis://dir:6379"
    assert load({"peer_directory_url": url, "peer_reads": True}).peer_directory_ttl_s == 300
    served = {"peer_directory_url": url, "pool_cache_size": "1GiB"}
    assert load({**served, "pool_serve_port": 7300}).peer_directory_url == url
    assert load({**served, "pool_socket": "/run/kvbm/pool.sock"}).peer_directory_url == url
    msg = _err(served)  # a pool nobody reads from: nothing to list
    assert msg.startswith("peer_directory_url (from kv_connector_extra_config) is set, but "), msg
    assert "peer_reads" in msg and "pool_serve_port" in msg, msg
    msg = _err({"peer_directory_ttl_s": 60})
    assert msg.startswith("peer_directory_ttl_s") and "peer_directory_url" in msg, msg
    msg = _err({"peer_directory_url": url, "peer_reads": True, "peer_directory_ttl_s": 2})
    assert msg.startswith("peer_directory_ttl_s: 2 s is shorter than 3 s"), msg


def test_peer_directory_url_refuses_a_password_and_takes_the_remote_tiers(tmp_path):
    msg = _err({"peer_directory_url": "redis://u:hunter2x@dir:6379", "peer_reads": True})
    assert msg.startswith("peer_directory_url: ") and "hunter2x" not in msg, msg
    assert "remote_password_file" in msg and "KVBM_REMOTE_PASSWORD" in msg, msg
    # an lm:// remote tier has no password, the directory does: accepted
    cfg = load({"remote_url": "lm://h:1", "peer_directory_url": "redis://dir:1",
                "peer_reads": True}, KVBM_REMOTE_PASSWORD="pw")
    assert cfg.remote_password.reveal() == "pw"
    msg = _err({"remote_url": "lm://h:1"}, KVBM_REMOTE_PASSWORD="pw")
    assert "LMCache server" in msg, msg
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    assert load({"peer_directory_url": "rediss://dir:1", "peer_reads": True,
                 "remote_tls_ca_file": str(ca)}).remote_tls_ca_file == str(ca)
    msg = _err({"peer_directory_url": "redis://dir:1", "peer_reads": True,
                "remote_tls_ca_file": str(ca)})
    assert msg.startswith("remote_tls_ca_file: ") and "peer_directory_url" in msg, msg


@pytest.mark.parametrize("raw", [0, -1, "soon", float("nan"), True])
def test_remote_timeout_must_be_positive_seconds(raw):
    with pytest.raises(KVBMConfigError, match="remote_timeout_s"):
        load_config({"remote_timeout_s": raw})


def test_disk_admission_choices():
    assert load_config({"disk_admission": "Frequency"}).disk_admission == "frequency"
    with pytest.raises(KVBMConfigError, match="disk_admission: 'lru' is not one of"):
        load_config({"disk_admission": "lru"})


# ---- every key: a wrong type and a wrong value ------------------------------

BAD_INPUT = {
    "disk_admission": [["always"], "lru"],
    "disk_admission_min_uses": ["x", 1.5, 0],
    "disk_cache_dir": [5, None, "/nonexistent/kvbm"],
    "disk_cache_size": [[1], "lots", "-1GiB"],
    "host_cache_blocks": [1.5, "many", 0],
    "host_cache_size": [None, "4 Gigs", -1],
    "load_split": [[1], "sometimes"],
    "metrics_host": [127, "", "local host"],
    "metrics_port": ["http", 0, 70000],
    "namespace": [5, ["a"]],  # any string is a namespace
    "nixl_backend": [3, "rdma"],
    "offload_decode_blocks": [[1], "sometimes"],
    "page_secret_file": [5, "/nonexistent/kvbm-page-secret"],  # more: test_page_auth.py
    "page_tokens": [0, "many", 2.5, True],  # not a multiple of --block-size: test_pages.py
    "remote_timeout_s": ["soon", True, 0, float("inf")],
    "remote_password_file": [5, "", "/nonexistent/kvbm-redis-password"],
    "remote_tls_ca_file": [5, "/nonexistent/ca.pem"],
    "remote_url": [5, "http://127.0.0.1:1234", "lm://h:0", "redis://h:0", "redis+cluster://h:1/2"],
    "tier_read_timeout_s": ["soon", True, 0, -1, float("nan")],
    "tier_write_queue_pages": [0, "lots", 2.5, True],
    "pool_cache_size": [[1], "lots", "-1GiB"],
    "pool_dir": [5, "/nonexistent/kvbm-pool"],
    "pool_socket": [5, "", ["/run/kvbm/pool.sock"]],
    "pool_serve_port": ["http", 0, 70000],
    "pool_serve_host": [127, "", "local host"],
    "peer_read_timeout_s": ["soon", True, 0, float("inf")],
    "peer_reads": [[1], "sometimes"],
    "peer_directory_url": [5, "http://h:1", "lm://h:1", "redis+cluster://h:1", "redis://h:0"],
    "peer_directory_ttl_s": ["soon", True, 0, float("nan")],
}


def test_bad_input_table_covers_every_key():
    assert sorted(BAD_INPUT) == config_keys()


@pytest.mark.parametrize("key,value", [(k, v) for k, vs in BAD_INPUT.items() for v in vs])
def test_every_key_rejects_bad_input_naming_itself(key, value):
    msg = _err({key: value})
    assert msg.startswith(f"{key}: "), msg
    assert repr(value) in msg or str(value) in msg, msg


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
    section = doc[doc.index("## Dynamo's variables"):]
    section = section[:section.index("\n## ")]
    accepted = section[:section.index("Not read")]
    assert set(re.findall(r"`(DYN_KVBM_\w+)`", accepted)) == set(DYNAMO_ENV)
    for name in ("DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS", "DYN_KVBM_CACHE_STATS_MAX_REQUESTS",
                 "DYN_KVBM_HOST_OFFLOAD_PREFIX_MIN_PRIORITY"):
        assert name in section[len(accepted):], name


@pytest.mark.parametrize("value,want", [("true", "always"), ("1", "always"),
                                        ("false", "frequency"), ("off", "frequency")])
def test_dynamo_disk_offload_filter_is_frequency_admission(value, want):
    cfg = load(None, DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER=value)
    assert cfg.disk_admission == want
    assert cfg.disk_admission_min_uses == 2  # Dynamo: written to disk on the second use


def test_bad_dynamo_disk_offload_filter_names_the_variable_and_the_fix():
    msg = _err(None, DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER="sometimes")
    assert msg.startswith("DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER (sets disk_admission)"), msg
    assert "expected true" in msg and "'sometimes'" in msg


@pytest.mark.parametrize("extra,env,port", [
    (None, {"DYN_KVBM_METRICS": "true"}, 6880),  # Dynamo's default port
    (None, {"DYN_KVBM_METRICS": "1", "DYN_KVBM_METRICS_PORT": "7001"}, 7001),
    (None, {"DYN_KVBM_METRICS_PORT": "7001"}, 7001),
    (None, {"DYN_KVBM_METRICS": "false", "DYN_KVBM_METRICS_PORT": "7001"}, None),
    (None, {"DYN_KVBM_METRICS": "false", "KVBM_METRICS_PORT": "7002"}, 7002),
    ({"metrics_port": 7003}, {"DYN_KVBM_METRICS": "true"}, 7003),
    ({"metrics_port": 7003}, {"DYN_KVBM_METRICS": "false"}, 7003),
    (None, {"DYN_KVBM_METRICS": "  "}, None),
])
def test_dynamo_metrics_switch(extra, env, port):
    assert load(extra, **env).metrics_port == port


def test_bad_dynamo_metrics_switch_names_the_variable_and_the_fix():
    msg = _err(None, DYN_KVBM_METRICS="please", DYN_KVBM_METRICS_PORT="7001")
    assert msg.startswith("DYN_KVBM_METRICS (turns metrics_port on): expected true or false"), msg
    assert "'please'" in msg and "DYN_KVBM_METRICS_PORT" in msg
    msg = _err(None, DYN_KVBM_METRICS="true", DYN_KVBM_METRICS_PORT="http")
    assert msg.startswith("DYN_KVBM_METRICS_PORT (sets metrics_port: expected an integer"), msg


def test_unread_dynamo_variables_are_named_in_a_warning_never_their_values(caplog):
    env = {"DYN_KVBM_OBJECT_SECRET_KEY": "hunter2-secret",
           "DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS": "100",
           "DYN_KVBM_LEADER_ZMQ_HOST": "  ",  # blank: as good as unset
           "DYN_KVBM_CPU_CACHE_GB": "1", "DYN_KVBM_METRICS": "false"}
    with caplog.at_level("WARNING", logger="vllm_kvbm.config"):
        load(None, **env)
    [record] = caplog.records
    msg = record.getMessage()
    assert msg.startswith("KVBM: DYN_KVBM_DISK_CACHE_OVERRIDE_NUM_BLOCKS, "
                          "DYN_KVBM_OBJECT_SECRET_KEY are Dynamo's and not read"), msg
    assert "hunter2" not in caplog.text and "100" not in msg
    caplog.clear()
    with caplog.at_level("WARNING", logger="vllm_kvbm.config"):
        load(None, DYN_KVBM_CPU_CACHE_GB="1", DYN_KVBM_METRICS="true")
    assert not caplog.records
