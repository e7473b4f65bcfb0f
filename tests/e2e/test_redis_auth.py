"""The remote tier on Redis (RedisStore, RedisView) against real ``redis-server``s:
who may read and write: a wrong or missing password a startup error naming the key
(and never printed), an ACL user in the URL, another page secret's pages
unauthenticated and deleted, TLS with a private CA.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import redis
import torch

from helpers.tier_pages import SMALL, key, page
from test_redis_store import NS, PASSWORD, WRONG, RedisServer
from test_redis_store import _no_password_in_logs, server, stores  # noqa: F401 (fixtures)
from test_redis_store import pytestmark  # noqa: F401 (the same marks: redis-server, timeouts)
from vllm_kvbm.config import KVBMConfig, KVBMConfigError, load_config, parse_remote_url
from vllm_kvbm.tiers.redis.store import RedisStore
from vllm_kvbm.tiers.redis.view import RedisView


# ---- passwords -------------------------------------------------------------------


def test_wrong_or_missing_password_is_a_startup_error_naming_the_key(
    server, stores, tmp_path, caplog
):
    pw_file = tmp_path / "redis-password"
    pw_file.write_text(WRONG + "\n")
    cfg = load_config({"remote_url": server.url, "remote_password_file": str(pw_file)}, environ={})
    assert cfg.remote_password.reveal() == WRONG  # the newline is not part of it
    assert WRONG not in repr(cfg) and WRONG not in str(cfg.remote_password)
    for make in (
        lambda: RedisStore(
            parse_remote_url("remote_url", cfg.remote_url),
            cfg.remote_password,
            SMALL,
            NS,
            0,
            1,
            1.0,
        ),
        lambda: RedisView(cfg.remote_url, cfg.remote_password, NS, SMALL, 1, 1.0),
    ):
        with pytest.raises(KVBMConfigError) as info:
            make()
        msg = str(info.value)
        assert msg.startswith("remote_password_file: ") and str(pw_file) in msg, msg
        assert WRONG not in msg and PASSWORD not in msg, msg

    env_cfg = load_config({"remote_url": server.url}, environ={"KVBM_REMOTE_PASSWORD": WRONG})
    with pytest.raises(KVBMConfigError, match=r"^KVBM_REMOTE_PASSWORD: ") as info:
        RedisStore(
            parse_remote_url("remote_url", env_cfg.remote_url),
            env_cfg.remote_password,
            SMALL,
            NS,
            0,
            1,
            1.0,
        )
    assert WRONG not in str(info.value)

    with pytest.raises(KVBMConfigError, match="needs a password") as info:
        stores(server, password=None)
    assert "remote_password_file" in str(info.value) and "KVBM_REMOTE_PASSWORD" in str(info.value)
    assert WRONG not in caplog.text and PASSWORD not in caplog.text

    # The right one, from the environment: works, and still never printed.
    ok = load_config({"remote_url": server.url}, environ={"KVBM_REMOTE_PASSWORD": PASSWORD})
    s = RedisStore(
        parse_remote_url("remote_url", ok.remote_url), ok.remote_password, SMALL, NS, 0, 1, 1.0
    )
    try:
        assert s.put(key(1), page(1, SMALL)) and s.contains(key(1))
        assert PASSWORD not in repr(ok) and PASSWORD not in repr(KVBMConfig())
    finally:
        s.close()


def test_acl_user_in_the_url(server, stores):
    with server.admin() as c:
        c.acl_setuser(
            "kvbm", enabled=True, passwords=[f"+{WRONG}x"], keys=["kvbm_*"], commands=["+@all"]
        )
    s = stores(url=f"redis://kvbm@127.0.0.1:{server.port}", password=WRONG + "x")
    assert s.put(key(1), page(1, SMALL)) and s.contains(key(1))
    with pytest.raises(KVBMConfigError, match="ACL user kvbm") as info:
        stores(url=f"redis://kvbm@127.0.0.1:{server.port}", password=WRONG)
    assert WRONG not in str(info.value)


def test_pages_of_another_page_secret_are_unauthenticated_and_removed(server, stores):
    a = stores(server, secret=b"A" * 32)
    b = stores(server, secret=b"A" * 32)
    other = stores(server, secret=b"B" * 32)
    out = torch.empty(SMALL, dtype=torch.uint8)
    assert a.put(key(1), page(1, SMALL)) and a.put(key(2), page(2, SMALL))
    assert b.get_into(key(1), out) == "ok" and torch.equal(out, page(1, SMALL))
    # Names are keyed by the secret: another secret does not even find the page...
    assert not other.contains(key(2)) and other.get_into(key(2), out) == "miss"
    # ...and copied under its name, the page does not open there.
    with server.admin() as c:
        c.set(other._page_name(key(2)), c.get(a._page_name(key(2))))
    assert other.get_into(key(2), out) == "unauthenticated"
    assert not other.contains(key(2))  # deleted
    assert b.get_into(key(2), out) == "ok" and torch.equal(out, page(2, SMALL))


def _tls_files(d) -> tuple[str, str, str]:
    """A CA and a server certificate for 127.0.0.1, made with the openssl CLI."""
    ca_key, ca, key_, csr, crt, ext = (
        str(d / n)
        for n in ("ca.key", "ca.pem", "server.key", "server.csr", "server.pem", "ext.cnf")
    )
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    for cmd in (
        [
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            ca_key,
            "-out",
            ca,
            "-days",
            "2",
            "-subj",
            "/CN=kvbm-test-ca",
        ],
        [
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            key_,
            "-out",
            csr,
            "-subj",
            "/CN=127.0.0.1",
        ],
        [
            "x509",
            "-req",
            "-in",
            csr,
            "-CA",
            ca,
            "-CAkey",
            ca_key,
            "-CAcreateserial",
            "-out",
            crt,
            "-days",
            "2",
            "-extfile",
            ext,
        ],
    ):
        subprocess.run(["openssl", *cmd], check=True, capture_output=True, timeout=60)
    return ca, crt, key_


class TLSRedisServer(RedisServer):
    def __init__(self, workdir):
        self.ca, crt, key_ = _tls_files(workdir)
        super().__init__(workdir)
        self.args += [
            "--port",
            "0",
            "--tls-port",
            str(self.port),
            "--tls-cert-file",
            crt,
            "--tls-key-file",
            key_,
            "--tls-ca-cert-file",
            self.ca,
            "--tls-auth-clients",
            "no",
        ]

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}"

    def admin(self) -> redis.Redis:
        return redis.Redis(
            "127.0.0.1",
            self.port,
            password=self.password,
            socket_timeout=5,
            ssl=True,
            ssl_ca_certs=self.ca,
        )


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_tls_server_with_a_private_ca(tmp_path, stores):
    srv = TLSRedisServer(tmp_path).start()
    try:
        s = stores(srv, ca=srv.ca)
        v = stores(srv, ca=srv.ca, view=True)
        out = torch.empty(SMALL, dtype=torch.uint8)
        assert s.put(key(1), page(1, SMALL)) and v.contains(key(1))
        assert s.get_into(key(1), out) == "ok" and torch.equal(out, page(1, SMALL))
        # Without the CA the certificate does not verify: a startup error naming the key.
        with pytest.raises(KVBMConfigError, match="^remote_tls_ca_file: .* did not verify"):
            stores(srv)
        # Plain RESP to the TLS port: no answer it can read; calls miss, nothing raises.
        plain = stores(url=f"redis://127.0.0.1:{srv.port}")
        assert not plain.put(key(2), page(2, SMALL)) and plain.get_into(key(1), out) == "error"
    finally:
        srv.kill()
