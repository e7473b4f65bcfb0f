"""vllm_kvbm.config.secrets: one Secret class for the remote password and the
page secret, compared in constant time and never shown."""

from __future__ import annotations

import dataclasses
import hmac
import logging

from vllm_kvbm.config import KVBMConfig, load_config
from vllm_kvbm.config.secrets import Secret

PASSWORD = "pässwörd-Redis-42"  # not ASCII: hmac.compare_digest refuses such a str
PAGE_SECRET = b"\x00\xffpage-secret-0123456789abcdef"


def test_secret_compares_with_compare_digest(monkeypatch):
    calls, real = [], hmac.compare_digest

    def spy(a, b):
        calls.append((type(a), type(b)))
        return real(a, b)

    import vllm_kvbm.config.secrets as secrets_module

    monkeypatch.setattr(secrets_module.hmac, "compare_digest", spy)
    assert Secret(PASSWORD, "a") == Secret(PASSWORD, "b")  # the source is not compared
    assert Secret(PAGE_SECRET, "a") == Secret(bytearray(PAGE_SECRET), "b")
    assert Secret(PASSWORD, "a") != Secret(PASSWORD + "x", "a")  # other length
    assert Secret(PAGE_SECRET, "a") != Secret(PAGE_SECRET[:-1] + b"?", "a")  # same length
    assert calls == [(bytes, bytes)] * 4  # every comparison went through compare_digest
    # A password and a key of the same bytes are different secrets; a raw value is none.
    assert Secret("abc", "a") != Secret(b"abc", "a")
    assert Secret(PASSWORD, "a") != PASSWORD and Secret(PAGE_SECRET, "a") != PAGE_SECRET
    assert len(calls) == 4
    # Equal secrets hash alike; the hash says nothing about the value.
    assert hash(Secret(PASSWORD, "a")) == hash(Secret(PAGE_SECRET, "b"))
    assert Secret(PASSWORD, "a").reveal() == PASSWORD
    assert Secret(bytearray(PAGE_SECRET), "a").reveal() == PAGE_SECRET


def _shown(text: str) -> bool:
    return (
        PASSWORD in text
        or PAGE_SECRET.hex() in text
        or "page-secret-0123" in text
        or repr(PAGE_SECRET) in text
        or "pässwörd" in text
    )


def test_no_form_of_a_config_shows_either_secret(tmp_path, caplog):
    pw_file = tmp_path / "redis-password"
    pw_file.write_text(PASSWORD + "\n")
    secret_file = tmp_path / "page.secret"
    secret_file.write_bytes(PAGE_SECRET)
    cfg = load_config(
        {
            "remote_url": "redis://127.0.0.1:6379",
            "remote_password_file": str(pw_file),
            "page_secret_file": str(secret_file),
        },
        environ={},
    )
    assert isinstance(cfg, KVBMConfig)
    assert cfg.remote_password.reveal() == PASSWORD and cfg.page_secret.reveal() == PAGE_SECRET
    assert type(cfg.remote_password) is type(cfg.page_secret) is Secret

    log = logging.getLogger("vllm_kvbm.test_config_secrets")
    with caplog.at_level(logging.DEBUG):
        log.info("config %s", cfg)
        log.info("config %r", cfg)
        log.info(cfg)
        log.info(
            "secrets %s %r %s %r",
            cfg.remote_password,
            cfg.remote_password,
            cfg.page_secret,
            cfg.page_secret,
        )
        log.info(f"f-string {cfg} {cfg!r} {cfg.remote_password} {cfg.page_secret}")
    assert len(caplog.records) == 5
    forms = [
        repr(cfg),
        str(cfg),
        f"{cfg}",
        f"{cfg!r}",
        format(cfg),
        repr(dataclasses.asdict(cfg)),
        caplog.text,
    ]
    for secret in (cfg.remote_password, cfg.page_secret):
        forms += [repr(secret), str(secret), f"{secret}", f"{secret!r}", format(secret)]
    for text in forms:
        assert not _shown(text), text
    assert "redis-password" in str(cfg.remote_password)  # the source is shown, to find it
    assert "page.secret" in repr(cfg.page_secret)

    env_cfg = load_config(
        {"remote_url": "redis://127.0.0.1:6379"},
        environ={
            "KVBM_REMOTE_PASSWORD": PASSWORD,
            "KVBM_PAGE_SECRET": "env-page-secret-0123456789",
        },
    )
    for text in (
        repr(env_cfg),
        str(env_cfg),
        f"{env_cfg.remote_password}",
        f"{env_cfg.page_secret!r}",
    ):
        assert PASSWORD not in text and "env-page-secret" not in text, text
