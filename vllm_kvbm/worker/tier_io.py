"""The lower tiers' I/O, off the engine thread: fetches into host slots and spills.

Each tier (disk, remote) gets a read thread and write threads of its own
(``store.write_inflight``: the disk writes several pages at once), so
a fetch (a waiting request's onboarding) never queues behind the tier's
spills, a slow remote never delays a disk read, and the engine thread never
blocks on a tier. A load whose pages live below the host tier is fetched
into its host slots here first; the worker then moves the whole job with one
NIXL read.

Each tier's writes are bounded (``write_queue_pages``): a spilled page
waits for a place in its tier's queue before its page is copied (a burst is
written at the tier's pace, its host slots pinned meanwhile), at most
SPILL_WAIT_S from the spill, and not at all for a tier that has given no
place back for STALL_S; one still without a place is dropped, counted
("dropped"), and reported like a page the tier does not have, so the
scheduler writes it again when it is next admitted. A tier slower than the offload rate so costs
write-throughs, never memory or reads.

Each fetch has a deadline: one that makes no progress (no group of its
pages read) for ``read_timeout_s`` is reported failed, so its request
recomputes instead of waiting on a frozen filesystem or a hung read. A read
cannot be cancelled once in a syscall, so the fetch stays tracked as
"reading" until it ends: its slots are not reused before that (see
KVBMWorker), and reads of it not started yet are cancelled: its read
thread stops at the next page. A store that reads by DMA (the peer tier)
reports a page whose read missed its own deadline "late": the read may
still write its host slot, so its fetch fails and stays "reading" the same
way until the store names the slot's read ended (take_ended_writes, asked
on the tier's read thread every _REAP_S while any is pending). Shutdown waits ``read_timeout_s`` at most for
reads and writes in progress (io_threads.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from vllm_kvbm.config import DEFAULT_TIER_READ_TIMEOUT_S, DEFAULT_TIER_WRITE_QUEUE_PAGES
from vllm_kvbm.cpus import widen_thread_affinity
from vllm_kvbm.io_threads import IOThreads, close_pools
from vllm_kvbm.tiers.page_format import copy_bytes
from vllm_kvbm.tiers.registry import open_stores
from vllm_kvbm.worker.tier_fetches import TierFetches, done_future

if TYPE_CHECKING:
    from vllm_kvbm.config import KVBMConfig
    from vllm_kvbm.engine_info import EngineInfo
    from vllm_kvbm.messages import KVBMWorkerMetadata, TransferJob
    from vllm_kvbm.tiers.base import TierStore
    from vllm_kvbm.worker.tier_fetches import _Fetch

logger = logging.getLogger(__name__)


class _WriteQueue:
    """Spills of one tier not written yet (queued or being written), at most ``cap``."""

    def __init__(self, cap: int):
        self.cap = cap
        # entered on the spill copy thread, left on the writers
        self._cond = threading.Condition()
        self.queued = 0
        self.peak = 0  # most ever queued at once (tests, debugging)
        self._moved_at = time.monotonic()  # a place last taken or given back
        self._closed = False

    def enter(self, deadline: float | None = None) -> bool:
        """Takes a place; when all are taken, waits for one until
        ``deadline`` (time.monotonic; None: no wait) while the tier moves:
        never longer than STALL_S since a place was last given back (a
        stalled tier makes no spill wait twice). False: none came."""
        with self._cond:
            while self.queued >= self.cap:
                if deadline is None or self._closed:
                    return False
                left = min(deadline, self._moved_at + STALL_S) - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            self.queued += 1
            self.peak = max(self.peak, self.queued)
            self._moved_at = time.monotonic()
            return True

    def leave(self) -> None:
        with self._cond:
            self.queued -= 1
            self._moved_at = time.monotonic()
            self._cond.notify()

    def close(self) -> None:
        """No more waiting for a place (shutdown: queued writes are dropped)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


# How long a spill's pages may wait for a place in a full write queue, from
# the spill: a burst (two prefill steps' pages back to back) is written at
# the tier's pace, its slots pinned meanwhile; a tier slower than the
# offload rate for longer costs write-throughs (dropped), never an
# unbounded hold on slots. A tier that gives no place back for STALL_S is
# not waited for at all.
SPILL_WAIT_S = 1.0
STALL_S = 0.25

# Read and write timings kept between two polls, at most (the metrics).
_MAX_TIMINGS = 10_000


class TierIO(TierFetches):
    def __init__(
        self,
        write_queue_pages: int = DEFAULT_TIER_WRITE_QUEUE_PAGES,
        read_timeout_s: float = DEFAULT_TIER_READ_TIMEOUT_S,
    ) -> None:
        if write_queue_pages < 1:
            raise ValueError(f"write_queue_pages must be >= 1, got {write_queue_pages}")
        self.write_queue_pages = write_queue_pages
        self.read_timeout_s = read_timeout_s
        # TP rank: outcomes are reported per rank (vLLM sums the workers'
        # reports; a page is stored once every rank stored its shard)
        self.rank = 0
        self.tiers: dict[str, TierStore] = {}
        self._reader: dict[str, IOThreads] = {}
        self._writer: dict[str, IOThreads] = {}
        self.queues: dict[str, _WriteQueue] = {}
        self._fetching: list[_Fetch] = []
        self._stacks_at = -1e9  # an overdue fetch's threads last logged
        # Overdue fetches whose reads have ended since last asked (take_ended).
        self._ended: list[TransferJob] = []
        self._writing: list[tuple[str, bytes, Future]] = []
        # (job id, its pages' copy out of the host slots), in submission order
        self._spills: deque[tuple[int | None, Future]] = deque()
        self._copier: IOThreads | None = None  # started with the first tier
        self.spill_wait_s = SPILL_WAIT_S
        # (tier, seconds) of reads and writes ended, for the metrics: appended
        # on the tiers' threads, taken by poll (deque: no lock needed)
        self._read_times: deque[tuple[str, float]] = deque(maxlen=_MAX_TIMINGS)
        self._write_times: deque[tuple[str, float]] = deque(maxlen=_MAX_TIMINGS)
        self._usage_sent: dict[str, tuple[int, int]] = {}
        self._counts_sent: dict[str, dict[str, int]] = {}
        self._served_said = False  # pool_served_at reported
        self._dropped: list[tuple[str, bytes]] = []
        self._unreported, self._warned_at = 0, -1e9
        # late reads: the tiers' answers (which ended) pending and taken
        self._reaping: dict[str, Future] = {}
        self._reaped_at: dict[str, float] = {}
        self._writes_ended: set[tuple[str, int]] = set()

    def add(self, store: "TierStore", host_memory: torch.Tensor | None = None) -> None:
        """``host_memory``: the host tier's slots, where fetches land."""
        name = store.name
        self.tiers[name] = store
        self._reader[name] = IOThreads(1, f"kvbm-{name}-read", widen_thread_affinity)
        if host_memory is not None:  # first in the read thread's queue
            self._reader[name].submit(store.reads_into, host_memory)
        self._writer[name] = IOThreads(
            max(1, store.write_inflight), f"kvbm-{name}-write", widen_thread_affinity
        )
        self.queues[name] = _WriteQueue(self.write_queue_pages)
        if self._copier is None:
            self._copier = IOThreads(1, "kvbm-spill-copy", widen_thread_affinity)

    def spill(
        self, to: list[str], pages: list[tuple[bytes, torch.Tensor]], job_id: int | None = None
    ) -> None:
        """Writes each ``(key, host slot page)`` to the tiers ``to`` in the
        background. The pages are copied out of their slots on the spill copy
        thread, never on the engine thread (126 MiB of slots took it 25 ms of
        the next step), each once a place in a tier's write queue is free
        (waiting up to ``spill_wait_s`` from now; a tier with no place by
        then drops the page, no copy made), then written; ``poll`` reports
        ``job_id`` in ``spills_done`` once those copies ended or were
        dropped: the slots, pinned by the scheduler until then, may be reused."""
        todo = [(key, page, [t for t in to if t in self.tiers]) for key, page in pages]
        todo = [item for item in todo if item[2]]
        copies = (
            self._copier.submit(self._copy_out, todo, time.monotonic() + self.spill_wait_s)
            if todo and self._copier is not None
            else done_future(([], []))
        )
        self._spills.append((job_id, copies))

    def _copy_out(self, todo: list, deadline: float) -> tuple[list, list[tuple[str, bytes]]]:
        """On the spill copy thread: each page copied out of its slot (host
        memory only: the slot was spilled after every worker reported its
        store done) once its tiers' queues have a place, then queued on each
        tier's writers. -> the writes, and the (tier, key) of pages not
        queued (reported as dropped). Never raises."""
        writes, failed = [], []
        for key, slot_page, to in todo:
            # places free now first: a slow tier's wait delays no other's
            tiers = [tier for tier in to if self.queues[tier].enter()]
            tiers += [t for t in to if t not in tiers and self.queues[t].enter(deadline)]
            failed += [(tier, key) for tier in to if tier not in tiers]
            if not tiers:
                continue
            try:
                page = torch.empty_like(slot_page)
                copy_bytes(page, slot_page)
            except Exception as err:  # noqa: BLE001 - no memory for the copy
                logger.warning("KVBM: spill copy failed: %s", err)
                page = None
            for tier in tiers:
                future = None
                if page is not None:
                    try:
                        future = self._writer[tier].submit(
                            _write,
                            self.tiers[tier],
                            self.queues[tier],
                            key,
                            page,
                            self._write_times,
                        )
                    except Exception:  # noqa: BLE001 - closed under us
                        pass
                if future is None:
                    self.queues[tier].leave()
                    failed.append((tier, key))
                else:
                    writes.append((tier, key, future))
        return writes, failed

    def landed(self) -> list[tuple["TransferJob", int]]:
        """Each running fetch (not stopped) with its pages landed so far: the
        first n of its job, each intact in its host slot, never written again
        by the fetch (early_copies.py copies them while it reads the rest)."""
        return [
            (f.job, f.landed_prefix()) for f in self._fetching if not f.stopped() and not f.done()
        ]

    def poll(
        self, meta: "KVBMWorkerMetadata"
    ) -> list[tuple["TransferJob", bool, bool, int | None]]:
        """Records finished fetches and writes in ``meta``; returns the fetched
        load jobs, each with whether every page arrived intact, whether
        its reads are still running (an overdue fetch, failed: the slots it
        reads into must not be reused before take_ended() names it), and
        where it was cut (None: not cut; else the pages from there on are
        not loaded, the reads having ended, and the pages before are intact)."""
        ready, still = [], []
        now = time.monotonic()
        self._reap_late(now)
        for fetch in self._fetching:
            job = fetch.job
            done = fetch.done()
            if not done and fetch.runs_late(now):
                self._cut(fetch)
                done = fetch.done()
            if done and fetch.late:
                ended = fetch.late & self._writes_ended
                fetch.late -= ended
                self._writes_ended -= ended
            if not done and not fetch.overdue and now - fetch.progress > self.read_timeout_s:
                self._overdue(fetch, meta)  # cancels its reads not started yet
                done = fetch.done()
                ready.append((job, False, not done or bool(fetch.late), None))
                if not done or fetch.late:
                    still.append(fetch)  # until its reads end (take_ended)
                continue
            if not done or (fetch.overdue and fetch.late):
                still.append(fetch)
                continue
            if fetch.overdue:
                self._ended.append(job)  # reported failed already
                continue
            results = [r for f in fetch.futures if not f.cancelled() for r in f.result()]
            if fetch.late:
                # failed, its slots held until its late reads end: even when
                # cut, the pages after the cut are in slots they may write
                for tier, key, status in results:
                    meta.tier_events[(tier, status, self.rank)] += 1
                meta.bad_pages.extend((t, k) for t, k, status in results if status != "ok")
                logger.warning(
                    "KVBM: reading %d pages for %s: %d reads missed their "
                    "deadline; vLLM recomputes the pages, their host slots wait "
                    "for those reads to end",
                    len(results),
                    job.req_id,
                    len(fetch.late),
                )
                fetch.overdue = True
                ready.append((job, False, True, None))
                still.append(fetch)
                continue
            if fetch.cut_at is not None:
                cut = fetch.landed_prefix()  # reads that landed since count too
                for tier, _, status in results:
                    meta.tier_events[(tier, status, self.rank)] += 1
                ready.append((job, True, False, cut))
                continue
            bad = [(tier, key, status) for tier, key, status in results if status != "ok"]
            for tier, _, status in results:
                meta.tier_events[(tier, status, self.rank)] += 1
            if bad:
                logger.warning(
                    "KVBM: %d of %d lower-tier pages for %s unusable (%s); vLLM recomputes them",
                    len(bad),
                    len(results),
                    job.req_id,
                    ", ".join(sorted({f"{t}:{s}" for t, _, s in bad})),
                )
                meta.bad_pages.extend((tier, key) for tier, key, _ in bad)
            ready.append((job, not bad, False, None))
        self._fetching = still
        while self._spills and self._spills[0][1].done():  # one copy thread: in order
            job_id, copies = self._spills.popleft()
            writes, failed = [], []
            try:
                if not copies.cancelled():
                    writes, failed = copies.result()
            except Exception as err:  # noqa: BLE001 - the slots are still given back
                logger.warning("KVBM: spill copies failed: %s", err)
            self._writing += writes
            self._dropped += failed
            if job_id is not None:
                meta.spills_done[job_id] += 1  # the slots may be reused now
        writing = []
        for tier, key, future in self._writing:
            if future.done():
                ok = future.result()
                meta.tier_events[(tier, "stored" if ok else "refused", self.rank)] += 1
                if ok:
                    meta.tier_stored.append((tier, key))
                else:  # not there (disk full, server down): written again when reused
                    meta.removed_pages.append((tier, key))
            else:
                writing.append((tier, key, future))
        self._writing = writing
        for tier, key in self._dropped:
            meta.tier_events[(tier, "dropped", self.rank)] += 1
            # like a page the tier does not have: written again when next admitted
            meta.removed_pages.append((tier, key))
        self._warn_drops()
        for name, store in self.tiers.items():
            meta.removed_pages.extend((name, key) for key in store.take_removed())
            usage = store.usage()
            if usage is not None and usage != self._usage_sent.get(name):
                meta.tier_usage[(name, self.rank)] = self._usage_sent[name] = usage
            counts = store.counts()
            if counts and counts != self._counts_sent.get(name):
                meta.tier_counts[(name, self.rank)] = self._counts_sent[name] = counts
        if not self._served_said and self.rank == 0 and "pool" in self.tiers:
            # where peers read this engine's pool (KV events, the peer directory)
            pool = getattr(self.tiers["pool"], "pool", None)
            meta.pool_served_at = getattr(pool, "served_at", None) or ""
            self._served_said = True
        for times, out in (
            (self._read_times, meta.tier_read_seconds),
            (self._write_times, meta.tier_write_seconds),
        ):
            while times:
                out.append(times.popleft())
        return ready

    def _warn_drops(self) -> None:
        """Says so at most once a minute: under a sustained overload every step drops."""
        self._unreported += len(self._dropped)
        self._dropped = []
        now = time.monotonic()
        if self._unreported and now - self._warned_at >= 60:
            logger.warning(
                "KVBM: %d page writes dropped since last said: a lower tier is "
                "slower than the offload rate and its write queue "
                "(tier_write_queue_pages=%d) is full; those pages are written when "
                "next reused (said at most once a minute)",
                self._unreported,
                self.write_queue_pages,
            )
            self._unreported, self._warned_at = 0, now

    def close(self) -> None:
        """Drops queued reads and writes, waits up to ``read_timeout_s`` for
        those running (a hung filesystem's are left behind, said in a
        warning), then closes the stores."""
        for queue in self.queues.values():
            queue.close()  # a spill waiting for a place stops waiting
        pools = [self._copier] if self._copier is not None else []
        pools += [*self._reader.values(), *self._writer.values()]
        close_pools(pools, self.read_timeout_s, "lower tiers")
        for store in self.tiers.values():
            store.close()
        self.tiers, self._reader, self._writer, self._copier = {}, {}, {}, None


def _write(
    store: "TierStore",
    queue: _WriteQueue,
    key: bytes,
    page: torch.Tensor,
    times: "deque[tuple[str, float]]",
) -> bool:
    began = time.monotonic()
    try:
        return store.put(key, page)
    except Exception as err:  # a store must not take the engine down
        logger.warning("KVBM: %s write failed: %s", store.name, err)
        return False
    finally:
        times.append((store.name, time.monotonic() - began))
        queue.leave()


def layout_fingerprint(
    kv_caches: "dict[str, torch.Tensor]",
    num_blocks: int,
    block_dims: "dict[str, int] | None" = None,
) -> str:
    """A fingerprint of how this worker's KV cache lays out a page's bytes:
    per layer (in the order pages are cut) its name, dtype, the block dim and
    kernel blocks per block (page_mover.block_dim_of), and every other dim's
    size and stride, where a stride reaching past one block (it scales with
    num_blocks, which differs between engines sharing pages) counts only as
    "outside". Bound into every page (the header check of page_format and the
    seal of page_seal), so a page is read only by a worker that lays out its bytes alike."""
    import hashlib
    import json

    from vllm_kvbm.worker.page_mover import block_view

    layers = []
    for name, t in kv_caches.items():
        t, d, ratio = block_view(name, t, num_blocks, block_dims)
        block_stride = t.stride()[d]
        dims = [
            [t.shape[i], t.stride()[i] if t.stride()[i] < block_stride else -1]
            for i in range(t.dim())
            if i != d
        ]
        layers.append([name, str(t.dtype), d, ratio, dims])
    text = json.dumps(layers, separators=(",", ":"))
    return "kv-layout:" + hashlib.sha256(text.encode()).hexdigest()


def open_tiers(
    config: "KVBMConfig", info: "EngineInfo", rank: int, layout: str = ""
) -> list["TierStore"]:
    """This worker's stores of the configured disk and remote tiers (tiers/registry.py).
    ``layout``: layout_fingerprint of this worker's KV cache ("" where unknown)."""
    return open_stores(config, info, rank, layout)
