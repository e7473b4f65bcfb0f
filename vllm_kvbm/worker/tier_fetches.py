"""Fetches from the lower tiers into host slots, TierIO's read side: a
fetch's record, its reads a group of pages at a time on each tier's read
thread, a fetch cut when it runs later than recomputing, one reported
overdue when it makes no progress, and the "late" DMA reads whose slots
wait until the tier names them ended (tier_io.py says why)."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from vllm_kvbm.io_threads import where_threads_are

if TYPE_CHECKING:
    from vllm_kvbm.messages import KVBMWorkerMetadata, TransferJob

logger = logging.getLogger(__name__)

# Pages read per call to a store, at most: a fetch's progress (its deadline,
# whether it runs late) is noted after each group; the disk reads a group
# several pages in flight. Groups start at one page and double while a group
# reads within _GROUP_S, so a slow link shows its pace after its first page
# (a cut or overdue fetch stops at its next page, see _Fetch.stopped).
_READ_GROUP = 32
_GROUP_S = 0.05

# How often a tier with "late" reads is asked which ended (seconds).
_REAP_S = 0.05
# An overdue fetch's log names where the tier's threads are at most this often.
STACKS_EVERY_S = 300.0


@dataclass
class _Fetch:
    job: "TransferJob"
    futures: list[Future] = field(default_factory=list)  # one per tier
    progress: float = field(default_factory=time.monotonic)  # last group read
    overdue: bool = False  # reported failed; polled until its reads end
    started: float = field(default_factory=time.monotonic)
    # by page index of the job: read intact into its host slot (pages not
    # fetched are in the host tier already)
    landed: list[bool] = field(default_factory=list)
    fetched: int = 0  # pages read intact so far
    # when its first group of reads ended, and the pages it held: the pace is
    # taken after it (the first read pays the tier's latency, a connection, a
    # server busy with writes: alone it says little of the pages after it)
    first_at: float | None = None
    first_pages: int = 0
    # pages landed when it was cut for running late (None: not cut); its
    # reads stop at their next page
    cut_at: int | None = None
    # (tier, host slot address) of its "late" reads not known ended: written
    # on the read thread, read by poll only once its reads are done
    late: set[tuple[str, int]] = field(default_factory=set)

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def stopped(self) -> bool:
        """Overdue or cut: its reads stop at their next page."""
        return self.overdue or self.cut_at is not None

    def landed_prefix(self) -> int:
        n = 0
        while n < len(self.landed) and self.landed[n]:
            n += 1
        return n

    def runs_late(self, now: float) -> bool:
        """Whether its pace since its first group of reads (pages read per
        second) says it ends after recomputing the pages not landed would
        have."""
        recompute = self.job.recompute_s
        if not recompute or self.cut_at is not None:
            return False
        n = self.landed_prefix()
        if n >= len(recompute):
            return False
        paced = self.fetched - self.first_pages
        if self.first_at is None or paced <= 0:
            # no pace yet: late once it took longer than recomputing all of it
            return now - self.started > recompute[n]
        left = len(self.job.fetch) - self.fetched
        return left * (now - self.first_at) / paced > recompute[n]


class TierFetches:
    """Part of ``TierIO`` (tier_io.py, which holds the state and polls the
    fetches): fetches into host slots, cut, overdue and late reads."""

    def fetch(self, job: "TransferJob", host_pool: torch.Tensor) -> None:
        """Starts reading ``job.fetch``'s pages into their host slots."""
        by_tier: dict[str, list[tuple[int, bytes]]] = {}
        for i, tier, key in job.fetch:
            by_tier.setdefault(tier, []).append((i, key))
        # One future per tier: the job is ready when all are.
        fetch = _Fetch(job, landed=[True] * len(job.slots))
        for i, _, _ in job.fetch:
            fetch.landed[i] = False
        for tier, items in by_tier.items():
            store = self.tiers.get(tier)
            # a peer's pages: from the peer the request's hint names
            peer = {"endpoint": job.peer or None} if tier == "peer" else {}

            def read(store=store, tier=tier, items=items, peer=peer):
                # A group of pages per call (the disk reads several in flight),
                # the fetch's progress noted after each.
                results, start, size = [], 0, 1
                first = time.monotonic()
                while start < len(items) and not fetch.stopped():
                    group = items[start : start + size]
                    began = time.monotonic()
                    try:
                        statuses = store.get_many_into(
                            [(key, host_pool[job.slots[i]]) for i, key in group],
                            stop=fetch.stopped,
                            **peer,
                        )
                    except Exception as err:  # a store must not take the engine down
                        logger.warning("KVBM: %s read failed: %s", tier, err)
                        statuses = ["error"] * len(group)
                    for (i, _), status in zip(group, statuses):
                        if status == "ok":
                            fetch.landed[i] = True
                            fetch.fetched += 1
                        elif status == "late":  # its slot may still be written
                            fetch.late.add((tier, host_pool[job.slots[i]].data_ptr()))
                    results += [
                        (tier, key, "error" if status == "late" else status)
                        for (_, key), status in zip(group, statuses)
                    ]
                    fetch.progress = time.monotonic()
                    if fetch.first_at is None:
                        fetch.first_at, fetch.first_pages = fetch.progress, fetch.fetched
                    start += len(group)
                    if fetch.progress - began < _GROUP_S:
                        size = min(2 * size, _READ_GROUP)
                if results:
                    self._read_times.append((tier, time.monotonic() - first))
                return results

            fetch.futures.append(
                self._reader[tier].submit(read)
                if store is not None
                else done_future([(tier, key, "error") for _, key in items])
            )
        self._fetching.append(fetch)

    def _reap_late(self, now: float) -> None:
        """Asks each tier with late reads of done fetches which ended (on its
        read thread, every _REAP_S at most); takes the answers that came."""
        for tier, future in list(self._reaping.items()):
            if future.done():
                del self._reaping[tier]
                if not future.cancelled() and future.exception() is None:
                    self._writes_ended.update((tier, a) for a in future.result())
        tiers = {t for f in self._fetching if f.late and f.done() for t, _ in f.late}
        for tier in tiers - self._reaping.keys():
            if now - self._reaped_at.get(tier, -1e9) >= _REAP_S:
                self._reaped_at[tier] = now
                try:
                    self._reaping[tier] = self._reader[tier].submit(
                        self.tiers[tier].take_ended_writes
                    )
                except RuntimeError:  # closing
                    pass

    def _cut(self, fetch: _Fetch) -> None:
        """Stops a fetch that runs late: reads not started are cancelled, the
        running ones stop at their next page; the job then loads the pages
        landed and vLLM recomputes the rest."""
        fetch.cut_at = fetch.landed_prefix()
        for f in fetch.futures:
            f.cancel()
        logger.info(
            "KVBM: reading %d pages for %s runs later than recomputing them: "
            "cut after %d landed pages; vLLM recomputes the rest",
            len(fetch.job.fetch),
            fetch.job.req_id,
            fetch.cut_at,
        )

    def _overdue(self, fetch: _Fetch, meta: "KVBMWorkerMetadata") -> None:
        fetch.overdue = True
        for f in fetch.futures:
            f.cancel()  # its reads not started yet never will be
        tiers = sorted({tier for _, tier, _ in fetch.job.fetch})
        for _, tier, _ in fetch.job.fetch:
            meta.tier_events[(tier, "error", self.rank)] += 1
        logger.error(
            "KVBM: reading %d pages from %s for %s made no progress for %g s "
            "(tier_read_timeout_s); vLLM recomputes them",
            len(fetch.job.fetch),
            "/".join(tiers),
            fetch.job.req_id,
            self.read_timeout_s,
        )
        now = time.monotonic()
        if now - self._stacks_at >= STACKS_EVERY_S:
            # what the tier waits in (a syscall, a socket, a lock), for the operator
            self._stacks_at = now
            where = where_threads_are(tuple(f"kvbm-{tier}-" for tier in tiers))
            logger.warning("KVBM: %s threads at that moment: %s", "/".join(tiers), where)

    def take_ended(self) -> list["TransferJob"]:
        """Overdue fetches whose reads have ended since last asked: their
        slots may be reused now."""
        ended, self._ended = self._ended, []
        return ended


def done_future(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future
