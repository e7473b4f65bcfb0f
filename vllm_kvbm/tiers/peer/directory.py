"""Where a page is, for fleets without a router that says: a directory in Redis/Valkey.

Two kinds of keys on the ``peer_directory_url`` server (its password is the
remote tier's: ``remote_password_file`` / ``KVBM_REMOTE_PASSWORD``):

- ``kvbm:peer:<pool file name>:<table key hex>`` -> the rank-0 control
  endpoint (``tcp://HOST:PORT``) of the process serving that pool file, with
  a TTL (``peer_directory_ttl_s``). Rank 0's worker of an engine whose pool
  is served to peers (by its own peer server, or by kvbm-pool) writes one as
  a page enters its pool file, again when the page is written again and at a
  sweep of the file's slot table every third of the TTL (so a page that
  stays, or one found again in a reused file, stays listed), and deletes it
  (if it still names this endpoint) when the page leaves. Only rank 0's file
  is listed: a reader confirms every rank with the peer itself.
- ``kvbm:peer-alive:<endpoint>`` -> the serving process's incarnation, with
  a short TTL (LIVENESS_TTL_S), refreshed every LIVENESS_EVERY_S by the
  process serving the pool (the worker's peer server or kvbm-pool) and
  deleted when it stops: entries naming an endpoint without one are ignored,
  so a crashed engine's entries stop counting within seconds.

A reader (the scheduler's PeerView, for a request without a hint) makes one
MGET of the request's pages' entries for rank 0's file and one EXISTS per
endpoint named, and picks the live endpoint holding the longest run from the
first page asked (never this engine's own); that peer's own lookup then says
which pages it holds now. A stale entry is a miss, never a wrong page (and a
page read is checked against its key anyway).

Writes never wait: a bounded queue drained by a thread of its own in
pipelined batches; an entry that finds the queue full is dropped and counted
(the next sweep writes it). A directory that does not answer is a miss; its
link is re-made in the background with the usual backoff (tiers/reconnect.py).
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from vllm_kvbm.cpus import widened_thread
from vllm_kvbm.tiers.peer.protocol import parse_endpoint
from vllm_kvbm.tiers.pool.layout import EMPTY_KEY, ENTRY_BYTES
from vllm_kvbm.tiers.redis.connection import OnRedisLink

if TYPE_CHECKING:
    from vllm_kvbm.config import KVBMConfig
    from vllm_kvbm.tiers.redis.connection import RedisLink

logger = logging.getLogger(__name__)

KEY_PREFIX = "kvbm:peer"
ALIVE_PREFIX = "kvbm:peer-alive"
# A holder's liveness key: refreshed this often, gone this long after its
# last refresh (a process that stops cleanly deletes it at once).
LIVENESS_EVERY_S = 2.0
LIVENESS_TTL_S = 6.0
# Entries waiting to be written, at most, and per pipelined round trip.
QUEUE_ENTRIES = 16384
BATCH = 512
# Pages one lookup asks the directory about, and endpoints it considers.
MGET_MAX = 1024
MAX_CANDIDATES = 8
# Slots a sweep reads from the table at a time (a copy of 256 KiB).
_SWEEP_SLOTS = 4096
_HEAD = struct.Struct(f"<Q32s{ENTRY_BYTES - 40}x")  # generation, key

# Deletes KEYS[1] only while it holds ARGV[1]: another holder's entry (the
# same page in another machine's pool) or a restarted process's liveness is
# left alone.
_DEL_IF = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
)


def entry_key(file_name: str, tkey: bytes) -> str:
    return f"{KEY_PREFIX}:{file_name}:{tkey.hex()}"


def alive_key(endpoint: str) -> str:
    return f"{ALIVE_PREFIX}:{endpoint}"


def open_link(
    url: str, password, timeout_s: float, role: str, tls_ca_file: str | None = None
) -> "RedisLink":
    """A link to the directory at ``url``; a refused password raises
    KVBMConfigError naming the key that sets it."""
    from vllm_kvbm.config import parse_remote_url
    from vllm_kvbm.tiers.redis.connection import RedisLink

    return RedisLink(
        parse_remote_url("peer_directory_url", url),
        password,
        timeout_s,
        role=role,
        tls_ca_file=tls_ca_file,
        what="peer directory",
    )


def config_link(config: "KVBMConfig", role: str) -> "RedisLink":
    return open_link(
        config.peer_directory_url,
        config.remote_password,
        config.remote_timeout_s,
        role,
        config.remote_tls_ca_file,
    )


class DirectoryWriter:
    """The entries of one pool file, naming ``endpoint``: ``stored`` and
    ``removed`` queue them (memory only; any thread), a thread of its own
    writes them. ``pool``: the PoolFile whose table is swept every
    ``sweep_every_s`` (None: no sweep)."""

    def __init__(
        self,
        link: "RedisLink",
        file_name: str,
        endpoint: str,
        ttl_s: float,
        pool=None,
        queue_entries: int = QUEUE_ENTRIES,
        sweep_every_s: float | None = None,
    ):
        self._link = link
        self.file_name, self.endpoint = file_name, endpoint
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._pool = pool
        self._sweep_every_s = max(1.0, ttl_s / 3) if sweep_every_s is None else sweep_every_s
        self._next_sweep = time.monotonic()  # the first at once: a file found again
        self.queue_entries = queue_entries
        self._ops: deque[tuple[bytes, bool]] = deque()
        self._cv = threading.Condition()  # held for memory operations only
        self._busy = False
        self._closed = False
        # entries written, deleted, dropped (queue full), failed (no answer)
        self.written = self.deleted = self.dropped = self.failed = 0
        self.sweeps = 0
        self._drops_said, self._said_at = 0, -1e9
        self._thread = widened_thread(self._run, "kvbm-peer-directory")
        self._thread.start()

    def stored(self, tkey: bytes) -> None:
        """The page of table key ``tkey`` is in the file (now, or again)."""
        self._put(tkey, True)

    def removed(self, tkey: bytes) -> None:
        """The page of table key ``tkey`` left the file."""
        self._put(tkey, False)

    def _put(self, tkey: bytes, store: bool) -> None:
        with self._cv:
            if self._closed:
                return
            if len(self._ops) >= self.queue_entries:
                self.dropped += 1
                return
            self._ops.append((bytes(tkey), store))
            self._cv.notify()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Waits until every queued entry was sent (tests); False at the timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._ops or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def sweep_now(self) -> None:
        """Makes the next sweep start now (tests)."""
        with self._cv:
            self._next_sweep = time.monotonic()
            self._cv.notify()

    # -- the writing thread -------------------------------------------------------
    def _sweep_due(self) -> bool:
        return self._pool is not None and time.monotonic() >= self._next_sweep

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._ops or self._closed or self._sweep_due()):
                    self._cv.wait(
                        None
                        if self._pool is None
                        else max(0.01, self._next_sweep - time.monotonic())
                    )
                if self._closed:
                    self._ops.clear()
                    self._cv.notify_all()
                    return
                batch = [self._ops.popleft() for _ in range(min(BATCH, len(self._ops)))]
                self._busy = True
            try:
                if batch:
                    self._send(batch)
                else:
                    self._sweep()
            except Exception as err:  # noqa: BLE001 - the thread must go on
                logger.warning(
                    "KVBM: peer directory: writing %s's entries: %s", self.file_name, err
                )
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
            self._say_drops()

    def _send(self, batch: list[tuple[bytes, bool]]) -> None:
        file, endpoint, ttl_ms = self.file_name, self.endpoint, self._ttl_ms

        def write(client):
            pipe = client.pipeline(transaction=False)
            for tkey, store in batch:
                key = entry_key(file, tkey)
                if store:
                    pipe.set(key, endpoint, px=ttl_ms)
                else:
                    pipe.eval(_DEL_IF, 1, key, endpoint)
            pipe.execute()
            return True

        if self._link.call(write, False, "directory write"):
            stores = sum(1 for _, store in batch if store)
            self.written += stores
            self.deleted += len(batch) - stores
        else:
            self.failed += len(batch)

    def _sweep(self) -> None:
        """Every page in the file's table written again (its TTL renewed)."""
        self._next_sweep = time.monotonic() + self._sweep_every_s
        pool = self._pool
        g = pool.geometry
        for first in range(0, g.nslots, _SWEEP_SLOTS):
            if self._closed or pool.closed:
                return
            count = min(_SWEEP_SLOTS, g.nslots - first)
            table = bytes(pool.view[g.entry_off(first) : g.entry_off(first + count)])
            held = [
                (tkey, True)
                for gen, tkey in _HEAD.iter_unpack(table)
                if not gen & 1 and tkey != EMPTY_KEY
            ]
            for start in range(0, len(held), BATCH):
                self._send(held[start : start + BATCH])
        self.sweeps += 1

    def _say_drops(self) -> None:
        now = time.monotonic()
        if self.dropped > self._drops_said and now - self._said_at >= 60:
            logger.warning(
                "KVBM: peer directory: %d entries of %s dropped so far (the queue "
                "of %d was full: the directory is slower than pages enter the pool; "
                "the next sweep writes them; said at most once a minute)",
                self.dropped,
                self.file_name,
                self.queue_entries,
            )
            self._drops_said, self._said_at = self.dropped, now

    def close(self, timeout_s: float = 5.0) -> None:
        """Stops writing (entries queued are dropped; those written stay: the
        file and its pages outlive this process)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout_s)


class Liveness:
    """Keeps ``alive_key(endpoint)`` set (to ``token``, the serving process's
    incarnation) while the process runs; deleted at close."""

    def __init__(
        self,
        link: "RedisLink",
        endpoint: str,
        token: str,
        every_s: float = LIVENESS_EVERY_S,
        ttl_s: float = LIVENESS_TTL_S,
    ):
        self._link, self.endpoint, self.token = link, endpoint, token
        self._key = alive_key(endpoint)
        self._every_s, self._ttl_ms = every_s, max(1, int(ttl_s * 1000))
        self.beats = 0
        self._stop = threading.Event()
        self._thread = widened_thread(self._run, "kvbm-peer-alive")
        self._thread.start()

    def _run(self) -> None:
        key, token, ttl_ms = self._key, self.token, self._ttl_ms
        while not self._stop.is_set():
            if self._link.call(lambda c: c.set(key, token, px=ttl_ms), None, "liveness"):
                self.beats += 1
            self._stop.wait(self._every_s)

    def close(self, timeout_s: float = 5.0) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout_s)
        self._link.call(lambda c: c.eval(_DEL_IF, 1, self._key, self.token), None, "liveness")


class DirectoryReader(OnRedisLink):
    """Which live peer holds a run of pages, by rank 0's pool file ``file_name``."""

    def __init__(self, link: "RedisLink", file_name: str):
        self._link, self.file_name = link, file_name
        # lookups, those that named a peer and those that did not (each
        # counted once answered: the scheduler reads them from another thread)
        self.asked = self.found = self.missed = 0

    def locate(self, tkeys: list[bytes], exclude=frozenset()) -> str | None:
        """The endpoint whose entries name the longest run of ``tkeys`` (table
        keys, in the request's order) from the first, among live endpoints not
        in ``exclude``; None: none (or the directory did not answer). Entries
        naming an excluded or dead endpoint neither count nor end a run: the
        page may be held elsewhere too, and the peer's lookup tells."""
        if not tkeys:
            return None
        self.asked += 1
        best = self._locate(tkeys, exclude)
        if best is None:
            self.missed += 1
        else:
            self.found += 1
        return best

    def _locate(self, tkeys: list[bytes], exclude) -> str | None:
        names = [entry_key(self.file_name, t) for t in tkeys[:MGET_MAX]]
        values = self._link.call(lambda c: c.mget(names), None, "directory lookup")
        if values is None:
            return None
        entries = [_endpoint(v) for v in values]
        candidates: list[str] = []
        for e in entries:
            if e is not None and e not in exclude and e not in candidates:
                candidates.append(e)
                if len(candidates) == MAX_CANDIDATES:
                    break
        if not candidates:
            return None

        def exists(client):
            pipe = client.pipeline(transaction=False)
            for e in candidates:
                pipe.exists(alive_key(e))
            return pipe.execute()

        flags = self._link.call(exists, None, "liveness lookup")
        if flags is None:
            return None
        alive = [e for e, flag in zip(candidates, flags) if flag]
        skip = set(exclude) | (set(candidates) - set(alive))
        best, best_run = None, 0
        for e in alive:
            run = 0
            for entry in entries:
                if entry == e:
                    run += 1
                elif entry is None or entry not in skip:
                    break
            if run > best_run:
                best, best_run = e, run
        return best

    def close(self) -> None:
        self._link.close()


def _endpoint(value) -> str | None:
    """An entry's endpoint; None for none, or for one that is not an endpoint."""
    if not isinstance(value, bytes):
        return None
    try:
        text = value.decode()
        parse_endpoint(text)
        return text
    except (UnicodeDecodeError, ValueError):
        return None


class PoolDirectory:
    """What a worker's pool store tells the directory: its entries and, where
    this worker serves the pool itself, its endpoint's liveness."""

    def __init__(self, writer: DirectoryWriter, liveness: Liveness | None, link: "RedisLink"):
        self.writer, self.liveness, self._link = writer, liveness, link

    def stored(self, tkey: bytes) -> None:
        self.writer.stored(tkey)

    def removed(self, tkey: bytes) -> None:
        self.writer.removed(tkey)

    def close(self) -> None:
        if self.liveness is not None:
            self.liveness.close()
        self.writer.close()
        self._link.close()


def pool_directory(config: "KVBMConfig", pool, server, rank: int) -> PoolDirectory | None:
    """The directory writer of this worker's pool file: rank 0's, when the
    pool is served to peers (``pool.served_at``) and a directory is set;
    with the liveness of ``server`` (this worker's own peer server, None
    when kvbm-pool serves the file: it keeps the liveness itself)."""
    if config.peer_directory_url is None or rank != 0:
        return None
    endpoint = getattr(pool, "served_at", None)
    if endpoint is None:
        logger.warning(
            "KVBM: peer directory: this engine's pool is not served to peers, so "
            "none of its pages are listed in the directory"
        )
        return None
    link = config_link(config, "for the pool's entries")
    try:
        writer = DirectoryWriter(link, pool.name, endpoint, config.peer_directory_ttl_s, pool=pool)
        liveness = Liveness(link, endpoint, server.incarnation) if server is not None else None
    except BaseException:
        link.close()
        raise
    logger.info(
        "KVBM: peer directory: pages of %s listed at %s as held by %s (TTL %g s)",
        pool.path,
        link.target,
        endpoint,
        config.peer_directory_ttl_s,
    )
    return PoolDirectory(writer, liveness, link)
