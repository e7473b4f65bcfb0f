"""Reading pages from a peer's pool (``PeerStore``, the tier named "peer").

A peer is another machine's worker or kvbm-pool process serving its pool
files (server.py). A read names the peer by its control endpoint (the rank-0
``tcp://HOST:PORT`` a router names; this worker's rank is added to the
port), and for a batch of pages:

1. ``hello`` (when the peer is new, failed, or its answer is older than
   ``hello_every_s``): the peer's NIXL agent metadata (``add_remote_agent``),
   where its pool file's mapping lies, its geometry, and its incarnation.
   Another incarnation at the endpoint (the peer restarted) replaces the old
   agent entry (``remove_remote_agent``, a new generation), and a peer whose
   pages do not match ours (another scope) is refused;
2. one READ of each page's set of slot entries into a landing slot
   (landing.py), the key's slot picked from it;
3. one READ of each picked slot's page: its header into the landing slot,
   its payload straight into ``out`` where ``out`` lies in memory registered
   with ``reads_into`` (the host tier's slots; else the whole page into the
   landing slot, then copied into ``out``);
4. one READ of each picked entry again: the slot's generation and key must
   be the same as in (2) (the seqlock, pool/layout.py), else it is a miss;
5. the page checked in ``out`` (key, namespace scope, TP rank, layout, CRC,
   or the seal under the page secret): only "ok" is used. While another
   batch follows, a helper thread checks it (the checks need no landing
   slot) as the next batch's READs run: on one machine cma copies on the
   reading thread, so the copy and the check take a core each. Every check
   ends before the call returns.

Each step is one NIXL transfer for the whole batch, posted and polled on the
calling thread (TierIO's reader thread for this tier: on one machine UCX's
cma transport copies inside ``transfer()``), never on vLLM's. Every batch
has a deadline (``read_timeout_s``): past it the pages are "error" (vLLM
recomputes them), the READ's landing slots are quarantined until it ends,
and the peer is not asked again for ``retry_s``. A page whose payload READ
into ``out`` missed the deadline is "late": ``out`` may still be written
until ``take_ended_writes`` names its address, and the caller must neither
use nor reuse it until then (TierIO holds its host slot). A peer that dies mid-read
is reported by NIXL within a fraction of a second: "error", no hang.
Idle peers are dropped after ``idle_s``.

The store never writes to a peer: ``put`` refuses, ``remove`` does nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from vllm_kvbm.cpus import run_widened, widen_thread_affinity
from vllm_kvbm.io_threads import IOThreads
from vllm_kvbm.tiers.base import TierStore
from vllm_kvbm.tiers.page_codec import PageCodec
from vllm_kvbm.tiers.peer import protocol
from vllm_kvbm.tiers.peer.agent import NixlCallError, PeerAgent
from vllm_kvbm.tiers.peer.batch_reads import BatchReads, outcome
from vllm_kvbm.tiers.peer.landing import LandingSlots
from vllm_kvbm.tiers.peer.page_layers import LayeredReads
from vllm_kvbm.tiers.peer.peer_links import PeerLinks, _Peer
from vllm_kvbm.tiers.pool import layout
from vllm_kvbm.tiers.pool.layout import MAX_WAYS

if TYPE_CHECKING:
    from vllm_kvbm.config import KVBMConfig
    from vllm_kvbm.engine_info import EngineInfo

logger = logging.getLogger(__name__)

DEFAULT_READ_TIMEOUT_S = 2.0
# A batch waits at most this long for a layered read (page_layers.py) to close.
LAYERED_FIRST_S = 5.0
# Pages per batch (each batch waits on three READs in turn): as many as
# make about 64 MiB, 4 to 16. Over TCP on one machine 16 pages of 4 MiB read
# 1.3-1.5x faster than 4.
LANDING_BYTES = 64 << 20
LANDING_PAGES = (4, 16)


def landing_count(stored_bytes: int) -> int:
    low, high = LANDING_PAGES
    return max(low, min(high, LANDING_BYTES // max(1, stored_bytes)))


class PeerStore(BatchReads, LayeredReads, PeerLinks, TierStore):
    """``codec``: this worker's PageCodec; ``rank``: its TP rank (which
    peer port and pool file it reads)."""

    name = "peer"
    # check a batch on the helper thread while the next one is read (False:
    # on the reading thread, for measuring what the overlap buys)
    check_ahead = True

    def __init__(
        self,
        codec: PageCodec,
        rank: int,
        world_size: int,
        scope: bytes,
        file_name: str,
        *,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        landing_pages: int | None = None,
        hello_every_s: float = 5.0,
        idle_s: float = 300.0,
        retry_s: float | None = None,
    ):
        self._codec, self.rank, self.world_size = codec, rank, world_size
        self.page_bytes = codec.page_bytes
        self.scope, self.file_name = scope, file_name
        self.read_timeout_s = read_timeout_s
        self.hello_every_s, self.idle_s = hello_every_s, idle_s
        self.retry_s = 2 * read_timeout_s if retry_s is None else retry_s
        # UCX's async thread starts here: not on vLLM's worker thread's one core
        self._agent = run_widened(PeerAgent, "kvbm-peer-reader")
        if landing_pages is None:
            landing_pages = landing_count(codec.stored_bytes)
        self.landing = LandingSlots(self._agent, codec.stored_bytes, landing_pages, MAX_WAYS)
        # headers of pages read layer by layer (page_layers.py), once asked
        self.heads: LandingSlots | None = None
        # Agent, peers and landing slots serve TierIO's batch reads and layered
        # reads (worker/layer_reads.py), held for one READ or batch at a time;
        # batches wait while a layered read (its step waits) is open: the lock
        # alone is not fair.
        self._lock = threading.RLock()
        self._turn = threading.Condition(self._lock)
        self.layered_open = 0
        self._peers: dict[str, _Peer] = {}
        import zmq

        self._zmq_context = zmq.Context()  # one I/O thread for every peer's control link
        self._live_generations: set[int] = set()
        self._quarantine_marks: set[int] = set()  # landing slots _xfer quarantined
        # memory READ into in place (reads_into): (start, end, registration)
        self._memory: list[tuple[int, int, object]] = []
        self._checker = IOThreads(1, "kvbm-peer-check", widen_thread_affinity)
        self._checks: list[Future] = []  # this call's checks on the helper
        self.torn_reads = 0  # pages rewritten while read (misses by the seqlock)
        self._closed = False

    @classmethod
    def from_config(
        cls,
        config: "KVBMConfig",
        info: "EngineInfo",
        rank: int,
        secret: bytes | None,
        layout_fp: str,
    ) -> "PeerStore":
        world = info.key_namespace.tp_size
        codec = PageCodec.for_worker(info, rank, secret, layout_fp)
        digest = layout.name_digest(info.tier_namespace, info.page_bytes, rank, world)
        return cls(
            codec,
            rank,
            world,
            layout.scope_digest(info.tier_namespace, info.page_bytes, rank, world, layout_fp),
            layout.file_name(digest, rank, world),
            read_timeout_s=config.peer_read_timeout_s,
        )

    # -- TierStore ---------------------------------------------------------------
    def put(self, key: bytes, page: torch.Tensor) -> bool:
        return False  # a peer's pool is its own: never written from here

    def contains(self, key: bytes) -> bool:
        return False  # which peer: get_many_into names it

    def remove(self, key: bytes) -> None:
        pass

    def get_into(self, key: bytes, out: torch.Tensor, endpoint: str | None = None) -> str:
        return self.get_many_into([(key, out)], endpoint=endpoint)[0]

    def get_many_into(
        self, items: list[tuple[bytes, torch.Tensor]], stop=None, endpoint: str | None = None
    ) -> list[str]:
        """Reads each ``(key, out)`` from the peer at ``endpoint`` (its rank-0
        control endpoint); the statuses in order. Without an endpoint, or
        for a peer that cannot be asked now: "miss" / "error"."""
        if not items:
            return []
        if endpoint is None or self._closed:
            return ["miss"] * len(items)
        try:
            with self._lock:
                peer = self._ready_peer(endpoint)
        except Exception as err:  # noqa: BLE001 - a store must not take the engine down
            logger.warning("KVBM: peer tier: %s: %s", endpoint, err)
            return ["error"] * len(items)
        if peer is None:
            return ["error"] * len(items)
        statuses: list = []  # a status, or the Future of a page's check
        try:
            for start in range(0, len(items), self.landing.count):
                part = items[start : start + self.landing.count]
                if stop is not None and stop():
                    statuses += ["skipped"] * len(part)
                    continue
                if peer.remote is None or time.monotonic() < peer.down_until:
                    statuses += ["error"] * len(part)  # failed earlier in this call
                    continue
                try:
                    with self._lock:
                        self._turn.wait_for(lambda: not self.layered_open, LAYERED_FIRST_S)
                        statuses += self._read_batch(
                            peer, part, ahead=self.check_ahead and start + len(part) < len(items)
                        )
                except Exception as err:  # noqa: BLE001
                    logger.warning("KVBM: peer tier: read from %s failed: %s", peer.endpoint, err)
                    statuses += ["error"] * len(part)
        finally:
            # none outlives the call: a check may decrypt in place into ``out``
            checks, self._checks = self._checks, []
            for check in checks:
                check.exception()
        return [outcome(s) if isinstance(s, Future) else s for s in statuses]

    def reads_into(self, memory: torch.Tensor) -> None:
        """Registers ``memory`` (the host tier's slots) with this store's NIXL
        agent: a page whose ``out`` lies in it is READ in place, not copied
        out of a landing slot. Call it on the thread that reads (a failure
        is logged: pages then land in landing slots)."""
        addr, n = memory.data_ptr(), memory.numel() * memory.element_size()
        try:
            with self._lock:
                self._memory.append((addr, addr + n, self._agent.register(addr, n)))
        except NixlCallError as err:
            logger.warning(
                "KVBM: peer tier: pages are copied through landing slots: the "
                "host tier's memory could not be registered (%s)",
                err,
            )

    @property
    def reads_in_place(self) -> bool:
        """Whether ``reads_into`` registered the host tier's memory."""
        return bool(self._memory)

    def _in_place(self, out: torch.Tensor) -> bool:
        start = out.data_ptr()
        return any(lo <= start and start + self.page_bytes <= hi for lo, hi, _ in self._memory)

    def take_ended_writes(self) -> list[int]:
        """Addresses of "late" ``out``s whose READ has ended since last asked
        (they may be used again). Call it on the thread that reads."""
        with self._lock:
            self.reap()
            return self.landing.take_ended()

    def reap(self) -> int:
        """Frees the landing slots of quarantined READs that ended since (or
        whose peer is known gone); the slots freed. Each read does it first."""
        with self._lock:
            heads = self.heads.reap(self._gone) if self.heads is not None else 0
            return self.landing.reap(self._gone) + heads

    @property
    def quarantined(self) -> int:
        """Landing slots out of use behind a READ past its deadline."""
        return self.landing.quarantined + (self.heads.quarantined if self.heads else 0)

    def counts(self) -> dict[str, int]:
        return {"quarantined": self.quarantined}  # kvbm_peer_quarantined_slots

    def lookup(self, endpoint: str, keys: list[bytes]) -> list[bool]:
        """Which of ``keys`` the peer holds (its control endpoint answers from
        its own table: no NIXL)."""
        from vllm_kvbm.tiers.peer.control import peer_lookup

        return peer_lookup(
            protocol.rank_endpoint(endpoint, self.rank),
            self.file_name,
            self.scope,
            [layout.table_key(self._codec.names, k) for k in keys],
            self.read_timeout_s,
        )

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # a hello out uses its peer's link until it ends (its deadline)
        until = max((p.asking_until for p in self._peers.values() if p.asking), default=0.0)
        self._turn.wait_for(
            lambda: not any(p.asking for p in self._peers.values()),
            max(0.0, until - time.monotonic()) + 0.5,
        )
        asking = False
        for peer in self._peers.values():
            if peer.remote is not None and not self.quarantined:
                self._unload(peer, gone=False)
            if peer.asking:  # left open: a ZMQ socket closed under a poll aborts
                asking = True
            else:
                peer.link.close()
        self._peers.clear()
        if not asking:  # term() waits for every socket to close
            self._zmq_context.term()
        self._checker.shutdown(wait=False)
        landings = [self.landing] + ([self.heads] if self.heads is not None else [])
        for landing in landings:
            landing.close()  # reaps first
        # else left registered: a late READ may still write there
        if not any(landing.quarantined_dests for landing in landings):
            for _, _, reg in self._memory:
                self._agent.deregister(reg)
        self._memory = []
