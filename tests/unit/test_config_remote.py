"""vllm_kvbm.config: the remote tier's settings: which `remote_url`s are an LMCache
or Redis server (forms, hosts and ports, IPv6), the password from a file or a
variable, a private CA, the peer directory's URL, and `remote_timeout_s`."""

from __future__ import annotations

import pytest

from test_config import _err, load
from vllm_kvbm.config import KVBMConfigError, load_config


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:1234",
        "lm://host",
        "lm://h:0",
        "redis://h:0",
        "resp://h:1",
        "redis+cluster://a:1/1",
        "redis://h:1/x",
        "rediss://h:1?ssl_cert_reqs=none",
        "valkey://a b:1",
    ],
)
def test_remote_url_must_be_an_lmcache_or_redis_server(url):
    with pytest.raises(KVBMConfigError, match=r'remote_url: .* write it as "lm://HOST:PORT"'):
        load_config({"remote_url": url})


@pytest.mark.parametrize(
    "url,scheme,nodes,tls,cluster,db,user",
    [
        ("lm://h:65432", "lm", [("h", 65432)], False, False, 0, None),
        ("redis://cache.local", "redis", [("cache.local", 6379)], False, False, 0, None),
        ("rediss://kvbm@10.0.0.5:6380/3", "rediss", [("10.0.0.5", 6380)], True, False, 3, "kvbm"),
        ("valkey://[::1]:7000", "valkey", [("::1", 7000)], False, False, 0, None),
        ("valkeys://v:1/0", "valkeys", [("v", 1)], True, False, 0, None),
        (
            "redis+cluster://a:7000,b:7001,c",
            "redis",
            [("a", 7000), ("b", 7001), ("c", 6379)],
            False,
            True,
            0,
            None,
        ),
        ("rediss+cluster://u@a:1", "rediss", [("a", 1)], True, True, 0, "u"),
    ],
)
def test_remote_url_forms(url, scheme, nodes, tls, cluster, db, user):
    from vllm_kvbm.config import parse_remote_url

    assert load_config({"remote_url": url}).remote_url == url
    t = parse_remote_url("remote_url", url)
    assert (t.scheme, list(t.nodes), t.tls, t.cluster, t.db, t.username) == (
        scheme,
        nodes,
        tls,
        cluster,
        db,
        user,
    )
    assert t.resp == (scheme != "lm")
    assert parse_remote_url("remote_url", str(t)) == t  # the logged form reads back the same


@pytest.mark.parametrize(
    "url",
    [
        "redis://[::1",
        "redis://[zz::1]:1",
        "redis://::1:6379",
        "redis://h\n:1",
        "redis://h:1:2",
        "redis://h:",
        "lm://[::1]",
        "lm://h:1?x",
        "lm://h:1/",
        "lm://[::1]:70000",
        "redis://u@:1",
        "redis://[::1]:6379?db=1",
    ],
)
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
    assert (
        load_config({"remote_url": "redis://[::1]:6379/0"}, {}).remote_url == "redis://[::1]:6379/0"
    )


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
    assert (
        load({"remote_url": "redis://h:1"}, KVBM_REMOTE_PASSWORD="env-pw").remote_password.reveal()
        == "env-pw"
    )
    msg = _err(
        {"remote_url": "redis://h:1", "remote_password_file": str(pw)},
        KVBM_REMOTE_PASSWORD="env-pw",
    )
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
    assert load(
        {"remote_url": "rediss://h:1", "remote_tls_ca_file": str(ca)}
    ).remote_tls_ca_file == str(ca)
    assert load(
        {"remote_url": "valkeys+cluster://h:1"}, KVBM_REMOTE_TLS_CA_FILE=str(ca)
    ).remote_tls_ca_file == str(ca)
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
    cfg = load(
        {"remote_url": "lm://h:1", "peer_directory_url": "redis://dir:1", "peer_reads": True},
        KVBM_REMOTE_PASSWORD="pw",
    )
    assert cfg.remote_password.reveal() == "pw"
    msg = _err({"remote_url": "lm://h:1"}, KVBM_REMOTE_PASSWORD="pw")
    assert "LMCache server" in msg, msg
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    assert load(
        {"peer_directory_url": "rediss://dir:1", "peer_reads": True, "remote_tls_ca_file": str(ca)}
    ).remote_tls_ca_file == str(ca)
    msg = _err(
        {"peer_directory_url": "redis://dir:1", "peer_reads": True, "remote_tls_ca_file": str(ca)}
    )
    assert msg.startswith("remote_tls_ca_file: ") and "peer_directory_url" in msg, msg


@pytest.mark.parametrize("raw", [0, -1, "soon", float("nan"), True])
def test_remote_timeout_must_be_positive_seconds(raw):
    with pytest.raises(KVBMConfigError, match="remote_timeout_s"):
        load_config({"remote_timeout_s": raw})
