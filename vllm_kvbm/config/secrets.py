"""Secrets: the remote tier's password and the page secret, each held in a
``Secret``. They are read from a file or an environment variable, never from
kv_connector_extra_config (vLLM logs its whole kv_transfer_config at startup),
and no message, log line or repr shows them."""

from __future__ import annotations

import hmac
import os
from typing import Any, Mapping

from vllm_kvbm.config.errors import KVBMConfigError
from vllm_kvbm.config.urls import parse_remote_url


class Secret:
    """A password (str) or key (bytes). Never printed: repr and str name only
    its source; ``==`` takes the same time wherever the values differ."""

    __slots__ = ("_value", "source")

    def __init__(self, value: str | bytes, source: str):
        self._value = value if isinstance(value, str) else bytes(value)
        self.source = source  # e.g. "page_secret_file /etc/kvbm/page.secret"

    def reveal(self) -> str | bytes:
        """The value, as given: str for a password, bytes for a key."""
        return self._value

    def _bytes(self) -> bytes:
        value = self._value
        return value.encode() if isinstance(value, str) else value

    def __repr__(self) -> str:
        return f"Secret(<redacted>, from {self.source})"

    __str__ = __repr__

    def __eq__(self, other) -> bool:
        return (
            isinstance(other, Secret)
            and type(self._value) is type(other._value)
            and hmac.compare_digest(self._bytes(), other._bytes())
        )

    def __hash__(self) -> int:
        return hash(Secret)  # equal secrets must hash alike; the value must not leak


MIN_PAGE_SECRET_BYTES = 16  # = page_seal.MIN_SECRET_BYTES (a test checks)
_MAX_FILE_BYTES = 64 * 1024
_PASSWORD_FIX = (
    "write one password (the Redis/Valkey server's) into it, on one line, "
    "readable only by the engine's user (chmod 600 FILE)"
)
_PAGE_SECRET_FIX = (
    "put at least 32 random bytes in it, readable only by the engine's user "
    "(head -c 32 /dev/urandom > FILE && chmod 600 FILE), the same file on "
    "every engine sharing the disk or remote tier"
)


def _read_secret_file(key: str, value: Any, what: str, fix: str) -> bytes:
    """The bytes of the file at ``value`` less a trailing newline; errors name
    the file, never its content."""
    if not isinstance(value, str) or not value.strip():
        raise KVBMConfigError(f"{key}: expected the path of a file holding {what}, got {value!r}")
    try:
        with open(os.path.expanduser(value), "rb") as f:
            data = f.read(_MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise KVBMConfigError(
            f"{key}: {value!r} does not exist; create it ({fix}) or remove {key}"
        ) from None
    except IsADirectoryError:
        raise KVBMConfigError(
            f"{key}: {value!r} is a directory, not a file holding {what}; {fix}"
        ) from None
    except OSError as e:
        raise KVBMConfigError(
            f"{key}: cannot read {value!r} ({e.strerror or type(e).__name__}); make it a file "
            f"readable by the user the engine runs as, or fix the path"
        ) from None
    if len(data) > _MAX_FILE_BYTES:
        raise KVBMConfigError(
            f"{key}: {value!r} is over {_MAX_FILE_BYTES} bytes, not a secret file; {fix}"
        )
    secret = data.rstrip(b"\r\n")
    if not secret:
        raise KVBMConfigError(f"{key}: {value!r} is empty; {fix}")
    return secret


def _secret_env(
    environ: Mapping[str, str], kwargs: dict, sources: dict, env: str, field: str, file_key: str
) -> str | None:
    """The text of ``env``, or None when unset; refused when ``file_key`` set ``field`` too."""
    text = environ.get(env, "")
    if not text.strip():
        return None
    if field in kwargs:
        raise KVBMConfigError(
            f"{env} and {file_key} (from {sources[file_key]}) are both set; set only one of them"
        )
    return text


def parse_password_file(key: str, value: Any) -> Secret:
    """The remote tier's password from the file at ``value`` (one line)."""
    data = _read_secret_file(key, value, "the remote tier's password", _PASSWORD_FIX)
    text = data.decode("utf-8", "replace")
    if "\n" in text:
        raise KVBMConfigError(f"{key}: {value!r} is more than one line; {_PASSWORD_FIX}")
    return Secret(text, f"{key} {value}")


def remote_password_env(environ: Mapping[str, str], kwargs: dict, sources: dict) -> None:
    """KVBM_REMOTE_PASSWORD holds the password itself; a password needs a Redis/Valkey URL."""
    text = _secret_env(
        environ, kwargs, sources, "KVBM_REMOTE_PASSWORD", "remote_password", "remote_password_file"
    )
    if text is not None:
        kwargs["remote_password"] = Secret(text.rstrip("\r\n"), "KVBM_REMOTE_PASSWORD")
    password = kwargs.get("remote_password")
    url = kwargs.get("remote_url")
    # (the peer directory, a Redis/Valkey server, takes the same password)
    if (
        password is not None
        and url is not None
        and kwargs.get("peer_directory_url") is None
        and not parse_remote_url("remote_url", url).resp
    ):
        raise KVBMConfigError(
            f"{password.source.split()[0]}: a password is set, but remote_url {url!r} is an "
            f"LMCache server, which has no authentication; remove it or use a redis:// URL"
        )


def parse_page_secret_file(key: str, value: Any) -> Secret:
    """The page secret (it keys every disk/remote page's seal, tiers/page_seal.py)."""
    secret = _read_secret_file(key, value, "the page secret", _PAGE_SECRET_FIX)
    if len(secret) < MIN_PAGE_SECRET_BYTES:
        raise KVBMConfigError(
            f"{key}: the secret in {value!r} is shorter than {MIN_PAGE_SECRET_BYTES} bytes; "
            f"{_PAGE_SECRET_FIX}"
        )
    return Secret(secret, f"{key} {value}")


def page_secret_env(environ: Mapping[str, str], kwargs: dict, sources: dict) -> None:
    """KVBM_PAGE_SECRET holds the page secret itself."""
    text = _secret_env(
        environ, kwargs, sources, "KVBM_PAGE_SECRET", "page_secret", "page_secret_file"
    )
    if text is None:
        return
    text = text.strip()
    if len(text.encode()) < MIN_PAGE_SECRET_BYTES:
        raise KVBMConfigError(
            f"KVBM_PAGE_SECRET (the page secret): shorter than {MIN_PAGE_SECRET_BYTES} bytes; "
            f"set it to at least 32 random characters (e.g. openssl rand -hex 32), the same "
            f"on every engine sharing the disk or remote tier, or use page_secret_file"
        )
    kwargs["page_secret"] = Secret(text.encode(), "KVBM_PAGE_SECRET")
