"""The scheduler's read-only views of the tiers below host RAM.

The stores themselves run in the workers (``vllm_kvbm.tiers``); the
scheduler only asks whether a page exists, by its name, without LMCache:
the disk through the directory, the remote server through the ``lm://``
EXIST message or, on Redis/Valkey, EXISTS (redis-py, pipelined).
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_kvbm.config import parse_lm_url, parse_remote_url
from vllm_kvbm.cpus import widen_thread_affinity
from vllm_kvbm.keys import BlockKey
from vllm_kvbm.scheduler.tier_policy import LowerTiers
from vllm_kvbm.tiers.lm_protocol import REPLY_BYTES, exist_reply, exist_request
from vllm_kvbm.tiers.page_format import disk_page_namer, page_namer
from vllm_kvbm.tiers.redis_conn import RedisLink

if TYPE_CHECKING:
    from vllm_kvbm.config import KVBMConfig
    from vllm_kvbm.engine_info import EngineInfo

logger = logging.getLogger(__name__)


class DiskView:
    """The disk tier as the scheduler sees it: a page exists if its file does.

    The worker's store writes files atomically and LMCache's LRU deletes
    them, so the directory itself is the index: it is exact across engine
    restarts and needs no messages between the processes.
    """

    name = "disk"

    def __init__(self, directory: str, namespace: str, block_bytes: int, world_size: int,
                 secret: bytes | None = None):
        # ``secret``: the page secret, which keys the pages' names (page_format).
        self._paths = [
            disk_page_namer(directory, namespace, block_bytes, rank, world_size, secret)
            for rank in range(world_size)]

    def contains(self, key: BlockKey) -> bool:
        return all(os.path.exists(path(key)) for path in self._paths)


class RemoteView:
    """The remote tier as the scheduler sees it: EXIST on the server.

    Rank 0's page stands for all ranks; a rank missing its page fails that
    load, which vLLM then recomputes. Every call is bounded by ``timeout_s``;
    after a failure the connection is re-made at most every
    ``retry_interval_s`` and calls answer False (a miss) meanwhile.
    """

    name = "remote"

    def __init__(self, url: str, namespace: str, block_bytes: int, world_size: int,
                 timeout_s: float = 2.0, retry_interval_s: float = 2.0,
                 secret: bytes | None = None):
        self.url = url
        self._addr = parse_lm_url("remote_url", url)
        self._name = page_namer(namespace, block_bytes, 0, world_size, secret)
        self._timeout_s = timeout_s
        self._retry_s = retry_interval_s
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._next_try = 0.0
        self._down = False

    def contains(self, key: BlockKey) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: list[BlockKey]) -> list[bool]:
        """One round trip for all ``keys``: the server answers a connection's
        requests in order, so they are sent at once and the replies read
        back; the whole exchange is bounded by ``timeout_s``."""
        if not keys:
            return []
        with self._lock:
            sock = self._connection()
            if sock is None:
                return [False] * len(keys)
            deadline = time.monotonic() + self._timeout_s
            try:
                sock.sendall(b"".join(exist_request(self._name(key)) for key in keys))
                want = REPLY_BYTES * len(keys)
                reply = bytearray()
                while len(reply) < want:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"no answer within {self._timeout_s}s")
                    sock.settimeout(left)
                    chunk = sock.recv(want - len(reply))
                    if not chunk:
                        raise ConnectionError("server closed the connection")
                    reply += chunk
                found = [exist_reply(bytes(reply[i:i + REPLY_BYTES]))
                         for i in range(0, want, REPLY_BYTES)]
            except (OSError, ValueError) as err:
                self._drop(err)
                return [False] * len(keys)
            if self._down:  # once it answers: a frozen server still accepts connections
                logger.warning("KVBM: remote tier %s reachable again for lookups", self.url)
                self._down = False
            return found

    def _connection(self) -> socket.socket | None:
        if self._sock is not None:
            return self._sock
        now = time.monotonic()
        if now < self._next_try:
            return None
        try:
            sock = socket.create_connection(self._addr, timeout=self._timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as err:
            self._drop(err)
            return None
        self._sock = sock
        return sock

    def _drop(self, why) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._next_try = time.monotonic() + self._retry_s
        if not self._down:
            self._down = True
            logger.warning("KVBM: remote tier %s unavailable for lookups (%s); they miss "
                           "until it answers (retried at most every %.1fs)", self.url, why,
                           self._retry_s)

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


class RedisView:
    """A Redis/Valkey remote tier as the scheduler sees it: EXISTS on every
    TP rank's page, in one pipelined round trip.

    A page exists only if all ranks' pages do (an LRU server evicts them one
    by one). The call that finds the server dead or frozen waits at most
    ``timeout_s`` per socket operation; after it lookups miss at once while
    the link is re-made in the background, at most every
    ``retry_interval_s`` (the scheduler thread never waits on a reconnect).
    A refused password at startup is a KVBMConfigError naming the key.
    """

    name = "remote"

    def __init__(self, url: str, password, namespace: str, block_bytes: int, world_size: int,
                 timeout_s: float = 2.0, retry_interval_s: float = 2.0,
                 tls_ca_file: str | None = None, secret: bytes | None = None):
        self.url = url
        self._names = [
            page_namer(namespace, block_bytes, rank, world_size, secret)
            for rank in range(world_size)]
        self._link = RedisLink(parse_remote_url("remote_url", url), password, timeout_s,
                               retry_interval_s, "remote tier (lookups)", tls_ca_file)

    def contains(self, key: BlockKey) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: list[BlockKey]) -> list[bool]:
        if not keys:
            return []
        names = [name(key) for key in keys for name in self._names]

        def exists(client):
            pipe = client.pipeline(transaction=False)
            for n in names:
                pipe.exists(n)
            return pipe.execute()
        found = self._link.call(exists, None, "lookup")
        if found is None:
            return [False] * len(keys)
        ranks = len(self._names)
        return [all(found[i * ranks:(i + 1) * ranks]) for i in range(len(keys))]

    def close(self) -> None:
        self._link.close()


class BackgroundLookups:
    """Lower-tier lookups that may wait on a server, run on a thread of their
    own so that vLLM's scheduler thread never does.

    One question per request at a time: ``ask`` returns the answer once it is
    known, else None after queueing the question (the planner then answers
    vLLM "ask again next step"). An answer keeps serving the request while
    its lookup starts inside the run asked about (blocks before it meanwhile
    stored to the host tier by others, say), so a moving start never asks
    again; answers are dropped when the request is admitted or finished
    (``forget``). An answer older than ``REFRESH_S`` still serves (the
    request is never held back for it) while it is asked again, so a request
    that waits long for room sees pages written since (or gone). Nothing is
    copied per step: a question's keys are copied when it is queued.

    The same thread answers the write-through's question which reused pages
    the disk has already (``check_disk``, answers taken by ``take_checked``):
    a stat on a hung network filesystem blocks this thread, not vLLM's.
    """

    def __init__(self, lower: LowerTiers):
        self._lower = lower
        self._lock = threading.Lock()
        self._entries: dict[str, _Question] = {}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._checked: list[tuple[list[BlockKey], set[BlockKey]]] = []
        self.checks_pending = 0  # disk checks queued or being answered
        self._thread = threading.Thread(target=self._serve, name="kvbm-lookup", daemon=True)
        self._thread.start()

    def ask(self, req_id: str, keys: list[BlockKey], start: int,
            end: int) -> tuple[list[str], int] | None:
        """The lower tiers of the longest run held of ``keys[start:end]``, as
        (run, offset): block ``start + k`` is in tier ``run[offset + k]`` for
        ``offset + k < len(run)``. None: asked, not answered yet."""
        with self._lock:
            q = self._entries.get(req_id)
            if (q is not None and q.start <= start < q.start + q.count
                    and keys[q.start] == q.first  # same chain: same blocks
                    # an answer whose run ends before ``start`` says nothing of it
                    and (q.run is None or start - q.start <= len(q.run))):
                if q.run is None:
                    return None
                if not q.asking and time.monotonic() - q.answered_at > REFRESH_S:
                    q.asking = True
                    self._queue.put((req_id, q, keys[q.start:q.start + q.count]))
                return q.run, start - q.start
            q = self._entries[req_id] = _Question(start, keys[start], end - start)
        self._queue.put((req_id, q, keys[start:end]))
        return None

    def forget(self, req_id: str) -> None:
        with self._lock:
            self._entries.pop(req_id, None)

    def check_disk(self, ask: list[BlockKey], keys: list[BlockKey]) -> None:
        """Asks which of ``ask`` the disk holds; ``take_checked`` then returns
        ``keys`` with that set."""
        with self._lock:
            self.checks_pending += 1
        self._queue.put((None, list(ask), list(keys)))

    def take_checked(self) -> list[tuple[list[BlockKey], set[BlockKey]]]:
        with self._lock:
            done, self._checked = self._checked, []
        return done

    def _check(self, ask: list[BlockKey], keys: list[BlockKey]) -> None:
        try:
            on_disk = self._lower.on_disk(ask)
        except Exception as err:  # a view must not kill the thread: written again
            logger.warning("KVBM: disk check failed: %s", err)
            on_disk = set()
        with self._lock:
            self._checked.append((keys, on_disk))
            self.checks_pending -= 1

    def _serve(self) -> None:
        widen_thread_affinity()  # not the engine thread's one core (cpus.py)
        while True:
            req_id, q, keys = self._queue.get()
            if req_id is None:
                self._check(q, keys)
                continue
            with self._lock:
                if self._entries.get(req_id) is not q:
                    continue  # forgotten or asked again meanwhile
            try:
                run = self._lower.find_run_doubling(keys)
            except Exception as err:  # a view must not kill the thread: a miss
                logger.warning("KVBM: lower-tier lookup failed: %s", err)
                run = []
            with self._lock:
                q.run, q.answered_at, q.asking = run, time.monotonic(), False


# An answer this old is asked again (and serves until the new one is in).
REFRESH_S = 0.5


@dataclass
class _Question:
    start: int
    first: BlockKey
    count: int
    run: list[str] | None = None  # None: not answered yet
    answered_at: float = 0.0
    asking: bool = True  # queued or being answered


def lower_tiers(config: "KVBMConfig", info: "EngineInfo") -> LowerTiers:
    """The scheduler's views of the configured disk and remote tiers."""
    views: list = []
    namespace, world = info.tier_namespace, info.key_namespace.tp_size
    # The workers' stores name pages with the same secret (worker/tier_io.py).
    secret = config.page_secret.reveal() if config.page_secret is not None else None
    if config.disk_cache_dir is not None:
        config.disk_blocks(info.page_bytes)  # fails early if too small
        views.append(DiskView(config.disk_cache_dir, namespace, info.page_bytes, world,
                              secret))
    if config.remote_url is not None and parse_remote_url("remote_url", config.remote_url).resp:
        views.append(RedisView(config.remote_url, config.remote_password, namespace,
                               info.page_bytes, world, config.remote_timeout_s,
                               tls_ca_file=config.remote_tls_ca_file, secret=secret))
    elif config.remote_url is not None:
        views.append(RemoteView(config.remote_url, namespace, info.page_bytes, world,
                                config.remote_timeout_s, secret=secret))
    return LowerTiers(views, config.disk_admission, config.disk_admission_min_uses)
