"""A bounded, never-raising link to a Redis or Valkey server or cluster (RESP), via redis-py.

Shared by the scheduler's view (``view.py``) and the worker's store
(``store.py``); imports neither LMCache nor NIXL nor torch.

- Every socket operation (connect, send, receive) is bounded by ``timeout_s``;
  redis-py's own retries are off, so a call costs at most its timeouts.
- A wrong or missing password found when the link is first made is a
  ``KVBMConfigError`` naming the key that sets it (startup stops). Later
  (a restarted server with another password) it is an outage like any other.
- A dead or frozen server makes ``call`` return its ``fail`` value: the call
  that finds the outage waits at most its timeouts, then calls fail at once
  while a background thread re-makes the link with a jittered backoff from
  ``retry_interval_s`` (``tiers/reconnect.py``); the caller's thread never
  waits on a reconnect.
- An error the server answers (out of memory under ``noeviction``, a wrong
  type) fails that call only; the link stays up.
- The password never appears in a message: every logged error text is
  scrubbed of it, and the target is shown as the parsed URL (which has none).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, RedisClusterException, RedisError, ResponseError
from redis.maint_notifications import MaintNotificationsConfig
from redis.retry import Retry

from vllm_kvbm.cpus import widened_thread
from vllm_kvbm.config import KVBMConfigError
from vllm_kvbm.config.secrets import Secret
from vllm_kvbm.config.urls import RemoteTarget
from vllm_kvbm.tiers.reconnect import Reconnect

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Replies that mean the credentials, not the network, are wrong.
_AUTH_REPLIES = (
    "WRONGPASS",
    "NOAUTH",
    "NOPERM",
    "AUTH",
    "invalid password",
    "invalid username-password",
)


class OnRedisLink:
    """What a reader over a RedisLink (``self._link``) says of its server: the
    remote tier's view and the peer directory's reader alike."""

    _link: "RedisLink"

    @property
    def down(self) -> bool:
        return not self._link.up

    @property
    def link(self):
        return self._link.reconnect


class RedisLink:
    """One redis-py client (``redis.Redis`` or ``redis.cluster.RedisCluster``),
    replaced whole after a failure. ``call(fn, fail)`` runs ``fn(client)``."""

    def __init__(
        self,
        target: RemoteTarget,
        password: Secret | None,
        timeout_s: float,
        retry_interval_s: float = 2.0,
        role: str = "",
        tls_ca_file: str | None = None,
        what: str = "remote tier",
    ):
        if not target.resp:
            raise ValueError(f"{target} is not a Redis/Valkey URL")
        if not timeout_s > 0:
            raise KVBMConfigError(f"remote_timeout_s: must be positive, got {timeout_s!r}")
        self.target = target
        self._password = password
        self._timeout_s = float(timeout_s)
        self._what = what  # what the log names it: "remote tier", "peer directory"
        self._retry = Reconnect(retry_interval_s, what, str(target), role)
        self._tls_ca_file = tls_ca_file
        self._lock = threading.Lock()
        self._client = None
        self._closed = threading.Event()
        self._reconnecting = False
        self._warned: dict[str, float] = {}  # reply -> when last logged
        client = self._connect(at_startup=True)
        if client is None:
            self._start_reconnect()
        else:
            self._client = client
            self._retry.answered()

    # -- messages --------------------------------------------------------------
    def safe(self, err: Any) -> str:
        """``err`` as text, with the password (if any) masked."""
        text = f"{type(err).__name__}: {err}" if isinstance(err, BaseException) else str(err)
        if self._password is not None and self._password.reveal():
            text = text.replace(self._password.reveal(), "***")
        return text

    @property
    def up(self) -> bool:
        return self._client is not None

    @property
    def reconnect(self) -> Reconnect:
        """The link's backoff and up/down state (the metrics read it)."""
        return self._retry

    # -- connecting ---------------------------------------------------------------
    def _build(self):
        t = self.target
        kwargs: dict[str, Any] = dict(
            username=t.username,
            socket_timeout=self._timeout_s,
            socket_connect_timeout=self._timeout_s,
            retry=Retry(NoBackoff(), 0),
            ssl=t.tls,
            health_check_interval=0,
            decode_responses=False,
            # redis-py 7+ asks every new connection to enable maintenance
            # notifications (an extra round trip, refused by Redis < 8).
            maint_notifications_config=MaintNotificationsConfig(enabled=False),
            **({"ssl_ca_certs": self._tls_ca_file} if t.tls and self._tls_ca_file else {}),
            password=self._password.reveal() if self._password is not None else None,
        )
        if t.cluster:
            from redis.cluster import ClusterNode, RedisCluster

            return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in t.nodes], **kwargs)
        host, port = t.nodes[0]
        return redis.Redis(host=host, port=port, db=t.db, max_connections=8, **kwargs)

    def _auth_error(self, err: Exception) -> KVBMConfigError:
        if self._password is None:
            return KVBMConfigError(
                f"remote_password_file: {self.target} refused the connection ({self.safe(err)}); "
                f"it needs a password: write it into a file named by remote_password_file, or "
                f"set KVBM_REMOTE_PASSWORD"
            )
        key = self._password.source.split()[0]
        return KVBMConfigError(
            f"{key}: {self.target} refused the password from {self._password.source} "
            f"({self.safe(err)}); put the server's password (requirepass, or the ACL user "
            f"{self.target.username or 'default'}'s) there"
        )

    def _connect(self, at_startup: bool):
        """A fresh client that answered PING, or None. At startup a refused
        password raises KVBMConfigError; afterwards it is logged as an outage."""
        client = None
        try:
            client = self._build()
            client.ping()
            return client
        except (AuthenticationError, ResponseError, RedisClusterException) as err:
            _close(client)
            if at_startup and any(s.lower() in str(err).lower() for s in _AUTH_REPLIES):
                raise self._auth_error(err) from None
            self._retry.failed(self.safe(err))
        except (RedisError, OSError) as err:
            _close(client)
            if at_startup and "CERTIFICATE_VERIFY_FAILED" in str(err):
                raise KVBMConfigError(
                    f"remote_tls_ca_file: the certificate of {self.target} did not verify against "
                    f"{self._tls_ca_file or 'the system CAs'} ({self.safe(err)}); set "
                    f"remote_tls_ca_file to the PEM file of the CA that signed it"
                ) from None
            self._retry.failed(self.safe(err))
        except Exception as err:  # noqa: BLE001 - never into vLLM
            _close(client)
            self._retry.failed(self.safe(err))
        return None

    def _start_reconnect(self) -> None:
        with self._lock:
            if self._reconnecting or self._closed.is_set():
                return
            self._reconnecting = True
        widened_thread(self._reconnect_loop, "kvbm-redis-reconnect").start()

    def _reconnect_loop(self) -> None:
        try:
            while not self._closed.wait(self._retry.wait_s()):
                if not self._retry.may_try():
                    continue
                client = self._connect(at_startup=False)
                if client is None:
                    continue
                with self._lock:
                    if self._closed.is_set():
                        _close(client)
                        return
                    self._client = client
                self._retry.answered()
                return
        finally:
            with self._lock:
                self._reconnecting = False

    def _drop(self, client, why) -> None:
        with self._lock:
            if self._client is client:
                self._client = None
        _close(client)
        self._retry.failed(self.safe(why))
        self._start_reconnect()

    # -- calls ---------------------------------------------------------------------
    def call(self, fn: Callable[[Any], T], fail: T, what: str = "call") -> T:
        """fn(client), or ``fail`` when the link is down or the call fails."""
        client = self._client
        if client is None:
            return fail
        try:
            return fn(client)
        except ResponseError as err:
            if any(s.lower() in str(err).lower() for s in _AUTH_REPLIES[:3]):
                self._drop(client, err)
            else:  # the server answered: this call failed, the link is fine
                text, now = self.safe(err), time.monotonic()
                if now - self._warned.get(text, -1e9) >= 60:  # e.g. OOM on every put
                    if len(self._warned) > 64:
                        self._warned.clear()
                    self._warned[text] = now
                    logger.warning(
                        "KVBM: %s %s: %s failed: %s (said at most once a minute)",
                        self._what,
                        self.target,
                        what,
                        text,
                    )
            return fail
        except Exception as err:  # noqa: BLE001 - timeout, reset, cluster moved, ...
            self._drop(client, err)
            return fail

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            client, self._client = self._client, None
        _close(client)


def _close(client) -> None:
    if client is None:
        return
    try:
        client.close()
    except Exception:  # noqa: BLE001
        pass
