"""Disk and peer hits read layer by layer during the forward pass that uses them.

A disk or peer hit loaded asynchronously is read whole into its host slots
before the step that computes the request (tier_fetches.py): its time to
first token is the read plus a host hit. Where the step's host hits are
copied layer by layer (layer_copies.py), such a hit can be too: the
scheduler returns it to vLLM as synchronous, and this worker's read thread,
on the core vLLM's OpenMP threads leave free, reads layer 0's range of every
page into its host slot, posts that layer's copies into the engine, then
layer 1's, ... while the forward pass computes the layers before. vLLM's
wait for a layer waits for its read and its copy. A tier's pages are read
by its own group (tiers/disk/page_slices.py ``PageFiles``: a pread per page
and range; tiers/peer/page_layers.py: one NIXL READ per range for all of a
peer's pages).

What keeps it correct:
- A page's bytes still arrive in order and are checked as they go; the
  verdict comes after the last layer (for a peer's page, after its slot
  entry is read again: the seqlock). A page that is not "ok" fails its
  request's load (every layer was copied before the verdict; a failure
  before the last layer fails every load with pages read): vLLM
  recomputes their blocks and drops the step's token for them. The step's
  host hits are copied apart and never fail with a read (layer_copies.py).
- The forward pass waits for a step's reads until a deadline (a floor plus
  the bytes at READ_FLOOR_BPS); past it the loads with pages read fail the
  same way and layered reads stop for this worker until READS_BACK_AFTER_S after
  the late reads ended (disk hits load before the step meanwhile).
- Reads write host slots only, never engine blocks: a read still running
  past the deadline keeps its slots from the host tier (``slots_held``)
  until it ends (a peer's READ past its deadline: until NIXL ends it, which
  this thread polls for). The engine blocks get only the copies posted before.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from vllm_kvbm.cpus import name_os_thread
from vllm_kvbm.tiers.disk.page_slices import PageFiles

if TYPE_CHECKING:
    import torch

    from vllm_kvbm.messages import TransferJob
    from vllm_kvbm.worker.copy_runs import RegionTable

logger = logging.getLogger(__name__)

# The forward pass waits for a step's reads at most this floor plus their
# bytes at READ_FLOOR_BPS (a local disk's page cache reads 5-6 GB/s here, an
# NVMe drive 2-7 GB/s cold), and never longer than READ_WAIT_MAX_S (the
# scheduler sends at most LAYERED_READ_MAX_BYTES of disk pages a load).
READ_WAIT_MIN_S = 0.25
READ_FLOOR_BPS = 0.5e9
READ_WAIT_MAX_S = 2.5
# Layered reads come back this long after reads that missed their deadline ended.
READS_BACK_AFTER_S = 60.0
# How often the read thread asks a peer store whether READs that missed
# their deadline ended (their host slots held until then).
_LATE_POLL_S = 0.1


def layer_ranges(tables: "dict[str, RegionTable]") -> dict[str, tuple[int, int]] | None:
    """Each layer's (offset, bytes) in a host row, where each layer's part is
    one range and the ranges in vLLM's layer order tile the row (a page then
    arrives in order, layer by layer); None otherwise."""
    ranges, end = {}, 0
    for name, table in tables.items():
        order = table.host_offset.argsort()
        offsets, sizes = table.host_offset[order], table.sizes[order]
        if int(offsets[0]) != end or any(
            int(offsets[i + 1]) != int(offsets[i] + sizes[i]) for i in range(len(offsets) - 1)
        ):
            return None
        ranges[name] = (end, int(sizes.sum()))
        end += int(sizes.sum())
    rows = {int(t.row_bytes) for t in tables.values()}
    return ranges if rows == {end} else None


@dataclass(eq=False)
class StepReads:
    """One step's layered disk reads: (job, tier, key, slot) per page."""

    pages: list[tuple["TransferJob", str, bytes, int]]
    deadline: float
    statuses: list[str] = field(default_factory=list)  # per page, once ended
    failed: bool = False  # a page not "ok", or the deadline passed
    abandoned: bool = False  # the deadline passed: stop at the next range
    held: bool = False  # its slots were held from the host tier (ended late)
    # host slots' addresses READs past their deadline may still write
    late: list[int] = field(default_factory=list)
    ended: threading.Event = field(default_factory=threading.Event)
    started: float = field(default_factory=time.perf_counter)
    seconds: float = 0.0

    def slots(self) -> list[int]:
        return [slot for _, _, _, slot in self.pages]


class LayerReader:
    """The read thread, pinned to ``cpus`` (those the layer copies run on)."""

    def __init__(
        self,
        ranges: dict[str, tuple[int, int]],
        cpus: set[int],
        host_pool: "torch.Tensor",
        tiers: dict,
    ):
        self.ranges, self.cpus, self.host_pool, self.tiers = ranges, cpus, host_pool, tiers
        self._queue: deque = deque()
        self._cv = threading.Condition()
        self._late: deque[StepReads] = deque()  # ended after their step gave up on them
        # ended, but READs past their deadline may still write these host slots' addresses
        self._pending: list[tuple[StepReads, set[int]]] = []
        self._thread = threading.Thread(target=self._run, name="kvbm-layer-read", daemon=True)
        self._thread.start()

    def plan(self, jobs: "list[TransferJob]") -> StepReads:
        """The reads of the jobs' fetched pages, their deadline from now."""
        pages = [(job, tier, key, job.slots[i]) for job in jobs for i, tier, key in job.fetch]
        nbytes = len(pages) * self.host_pool.shape[1]
        wait = min(READ_WAIT_MAX_S, READ_WAIT_MIN_S + nbytes / READ_FLOOR_BPS)
        return StepReads(pages, time.perf_counter() + wait)

    def start(
        self, reads: StepReads, post: Callable[[str], None], fail: Callable[[], None]
    ) -> None:
        """Reads ``reads``' pages layer by layer: ``post(layer)`` once a layer
        is in every page's slot, ``fail()`` once the step cannot use them (a
        page not "ok", an error)."""
        outs = [self.host_pool[slot] for _, _, _, slot in reads.pages]  # torch here, not there
        with self._cv:
            self._queue.append((reads, outs, post, fail))
            self._cv.notify()

    def take_late(self) -> list[StepReads]:
        """Reads that ended after their step gave up on them, since last asked."""
        late = []
        while self._late:
            late.append(self._late.popleft())
        return late

    def _run(self) -> None:
        name_os_thread("kvbm-layer-read")  # not an OpenMP thread to bench/cores.py
        try:
            os.sched_setaffinity(0, self.cpus)
        except (OSError, ValueError) as err:
            logger.debug("KVBM: layer read thread left on its CPUs: %s", err)
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue, _LATE_POLL_S if self._pending else None)
                item = self._queue.popleft() if self._queue else False
            if item is None:
                return
            if self._pending:
                try:
                    self._reap()
                except Exception as err:  # noqa: BLE001 - asked again at the next poll
                    logger.warning("KVBM: layer-wise read: %s", err)
            if item is False:
                continue
            reads = item[0]
            try:
                self._read(*item)
            except Exception as err:  # noqa: BLE001 - _read says what it could not
                logger.warning("KVBM: layer-wise read failed: %s", err)
            finally:
                reads.seconds = time.perf_counter() - reads.started
                if reads.late:
                    self._pending.append((reads, set(reads.late)))
                else:
                    self._end(reads)

    def _end(self, reads: StepReads) -> None:
        """Nothing writes ``reads``' slots any more."""
        with self._cv:
            reads.ended.set()
            if reads.held:
                self._late.append(reads)

    def _reap(self) -> None:
        """Ends the reads whose late READs the stores say ended."""
        ended: set[int] = set()
        for store in self.tiers.values():
            if hasattr(store, "take_ended_layer_reads"):
                ended.update(store.take_ended_layer_reads())
        still = []
        for reads, addrs in self._pending:
            addrs -= ended
            if addrs:
                still.append((reads, addrs))
            else:
                self._end(reads)
        self._pending = still

    def hold(self, reads: StepReads) -> bool:
        """Whether ``reads`` still run: then they are held (their slots kept
        from the host tier) and come back through take_late once they end."""
        with self._cv:
            reads.held = not reads.ended.is_set()
            return reads.held

    def _open(self, reads: StepReads, tier: str, endpoint: str, items, ranges):
        """A group reading one tier's pages (one peer's, for the peer tier),
        or the status of them all."""
        store = self.tiers.get(tier)
        if hasattr(store, "open_layers"):  # a peer's: READs with the step's deadline
            left = reads.deadline - time.perf_counter()
            return store.open_layers(items, endpoint or None, ranges, time.monotonic() + left)
        if hasattr(store, "open_slices"):
            return PageFiles(store, items, ranges)
        return "error"

    def _read(self, reads: StepReads, outs, post, fail) -> None:
        """The step's reads, group by group and range by range; ``reads.late``:
        the host slots' addresses READs past their deadline may still write."""
        statuses = ["skipped"] * len(reads.pages)
        ranges = list(self.ranges.values())
        by_source: dict[tuple[str, str], list[int]] = {}
        for i, (job, tier, _, _) in enumerate(reads.pages):
            by_source.setdefault((tier, job.peer if tier == "peer" else ""), []).append(i)
        groups: list[tuple[list[int], object]] = []
        raised = False
        try:
            for (tier, endpoint), at in by_source.items():
                items = [(reads.pages[i][2], outs[i]) for i in at]
                group = self._open(reads, tier, endpoint, items, ranges)
                if isinstance(group, str):
                    for i in at:
                        statuses[i] = group
                    fail()
                    return
                groups.append((at, group))
                if not group.start():
                    fail()
                    return
            for k, name in enumerate(self.ranges):
                for _, group in groups:
                    if reads.abandoned or not group.read(k, lambda: reads.abandoned):
                        fail()
                        return
                post(name)
            for _, group in groups:
                group.finish()
                if any(s != "ok" for s in group.statuses):
                    fail()
        except Exception as err:  # noqa: BLE001 - a tier must not take the engine down
            logger.warning("KVBM: layer-wise read failed: %s", err)
            raised = True
            fail()
        finally:
            for at, group in groups:
                try:
                    reads.late += group.close()
                except Exception as err:  # noqa: BLE001 - the other groups still close
                    logger.warning("KVBM: layer-wise read: closing %s", err)
                for i, status in zip(at, group.statuses):
                    statuses[i] = status
            reads.statuses = ["error"] * len(reads.pages) if raised else statuses

    @property
    def running(self) -> bool:
        """Whether a read may still write host memory (the thread, or a READ
        past its deadline)."""
        return self._thread.is_alive() or bool(self._pending)

    def close(self) -> None:
        with self._cv:
            self._queue.append(None)
            self._cv.notify()
        self._thread.join(timeout=5.0)
