"""vllm_kvbm.config: parsing, validation messages, env overrides."""

from __future__ import annotations

import pytest

from vllm_kvbm.config import KVBMConfig, KVBMConfigError, config_keys, load_config, parse_size

GiB, MiB = 1024**3, 1024**2


def load(extra=None, **env):
    return load_config(extra, environ=env)


@pytest.mark.parametrize(
    "text,expected",
    [
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
    ],
)
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
    assert config_keys() == [
        "disk_admission",
        "disk_admission_min_uses",
        "disk_cache_dir",
        "disk_cache_size",
        "host_cache_blocks",
        "host_cache_size",
        "host_copy_path",
        "load_split",
        "metrics_host",
        "metrics_port",
        "namespace",
        "nixl_backend",
        "offload_decode_blocks",
        "page_secret_file",
        "page_tokens",
        "peer_directory_ttl_s",
        "peer_directory_url",
        "peer_read_timeout_s",
        "peer_reads",
        "pool_cache_size",
        "pool_dir",
        "pool_serve_host",
        "pool_serve_port",
        "pool_socket",
        "remote_password_file",
        "remote_timeout_s",
        "remote_tls_ca_file",
        "remote_url",
        "tier_read_timeout_s",
        "tier_write_queue_pages",
    ]


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


@pytest.mark.parametrize(
    "value,fragments",
    [
        ("lots", ["host_cache_size", "cannot read 'lots'", '"16GiB"', '"16GB"']),
        (
            "4 Gigs",
            [
                "host_cache_size",
                "unknown unit 'Gigs'",
                '"16Gi"',
                '"16G"',
                "1024-based",
                "1000-based",
            ],
        ),
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
        (16, ["host_cache_size: 16 has no unit", '"16GiB"', "--kv-offloading-size 16"]),
        ("16", ["host_cache_size: '16' has no unit", '"16GiB"', "at least 1048576"]),
        (0.5, ["host_cache_size: 0.5 has no unit", '"0.5GiB"']),
        ("1048575", ["has no unit"]),
    ],
)
def test_bad_sizes(value, fragments):
    msg = _err({"host_cache_size": value})
    for frag in fragments:
        assert frag in msg, (frag, msg)


@pytest.mark.parametrize(
    "value,fragment",
    [
        (0, "must be >= 1, got 0"),
        (-3, "must be >= 1, got -3"),
        ("x", "expected an integer, got 'x'"),
        ("1.5", "expected an integer, got '1.5'"),
        (2.0, "expected an integer, got 2.0"),
        (True, "expected an integer, got True"),
    ],
)
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
    assert '"192MiB" for 64 pages' in msg
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
    with pytest.raises(
        KVBMConfigError,
        match=r"disk_cache_dir: directory .* does not exist; "
        r"create it \(mkdir -p",
    ):
        load_config({"disk_cache_dir": str(missing)})
    with pytest.raises(KVBMConfigError, match="KVBM_DISK_CACHE_DIR"):
        load_config({}, {"KVBM_DISK_CACHE_DIR": str(missing)})


def test_disk_tier_too_small_for_one_block(tmp_path):
    cfg = load_config({"disk_cache_dir": str(tmp_path), "disk_cache_size": "1MiB"})
    with pytest.raises(KVBMConfigError, match="disk_cache_size: .* cannot hold one KV page"):
        cfg.disk_blocks(2 << 20)
    assert (
        load_config({"disk_cache_dir": str(tmp_path), "disk_cache_size": "1GiB"}).disk_blocks(
            2 << 20
        )
        > 400
    )


def test_host_copy_path_choices():
    assert load_config({}).host_copy_path == "auto"
    assert load_config({"host_copy_path": "Threads"}).host_copy_path == "threads"
    assert load({}, KVBM_HOST_COPY_PATH="nixl").host_copy_path == "nixl"
    with pytest.raises(KVBMConfigError, match="host_copy_path: 'memcpy' is not one of AUTO"):
        load_config({"host_copy_path": "memcpy"})


def test_disk_admission_choices():
    assert load_config({"disk_admission": "Frequency"}).disk_admission == "frequency"
    with pytest.raises(KVBMConfigError, match="disk_admission: 'lru' is not one of"):
        load_config({"disk_admission": "lru"})


# ---- every key: a wrong type and a wrong value ------------------------------

BAD_INPUT = {
    "disk_admission": [["always"], "lru"],
    "host_copy_path": [1, "memcpy"],
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
    "page_secret_file": [5, "/nonexistent/kvbm-page-secret"],  # more: test_page_secret.py
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
