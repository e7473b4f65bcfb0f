"""Disk hits read layer by layer during the forward pass that uses them.

A disk hit loaded asynchronously is read whole into its host slots before
the step that computes the request (tier_fetches.py): its time to first
token is the read plus a host hit. Where the step's host hits are copied
layer by layer (layer_copies.py), a disk hit can be too: the scheduler
returns it to vLLM as synchronous, and this worker's read thread, on the
core vLLM's OpenMP threads leave free, reads layer 0's range of every page
into its host slot, posts that layer's copies into the engine, then layer
1's, ... while the forward pass computes the layers before. vLLM's wait for
a layer waits for its read and its copy.

What keeps it correct:
- A page's bytes still arrive in order and are checked as they go
  (tiers/disk/page_slices.py); the verdict comes after the last layer. A
  page that is not "ok" (or a read that fails) fails the step's layered
  loads: vLLM recomputes their blocks and drops the step's token for them.
- The forward pass waits for a step's reads until a deadline (a floor plus
  the bytes at READ_FLOOR_BPS); past it the step's loads fail the same way
  and layered reads stop for this worker until READS_BACK_AFTER_S after
  the late reads ended (disk hits load before the step meanwhile).
- Reads write host slots only, never engine blocks: a read still running
  past the deadline keeps its slots from the host tier (``slots_held``)
  until it ends. The engine blocks get only the copies posted before.
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
from vllm_kvbm.tiers.page_format import HEADER_BYTES

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
# Layers of every page asked of the kernel ahead of the one being read (a
# page not in the page cache then arrives while earlier layers are copied).
_AHEAD = 2


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
                self._cv.wait_for(lambda: self._queue)
                item = self._queue.popleft()
            if item is None:
                return
            reads = item[0]
            try:
                self._read(*item)
            finally:
                reads.seconds = time.perf_counter() - reads.started
                with self._cv:
                    reads.ended.set()
                    if reads.held:
                        self._late.append(reads)

    def hold(self, reads: StepReads) -> bool:
        """Whether ``reads`` still run: then they are held (their slots kept
        from the host tier) and come back through take_late once they end."""
        with self._cv:
            reads.held = not reads.ended.is_set()
            return reads.held

    def _read(self, reads: StepReads, outs, post, fail) -> None:
        opened = []
        statuses = ["skipped"] * len(reads.pages)
        layers = list(self.ranges.values())
        try:
            for i, ((_, tier, key, _), out) in enumerate(zip(reads.pages, outs)):
                store = self.tiers.get(tier)
                page = store.open_slices(key, out) if store is not None else "error"
                if isinstance(page, str):
                    statuses[i] = page
                    fail()
                    return
                opened.append(page)
                page.ahead(-HEADER_BYTES, HEADER_BYTES + sum(n for _, n in layers[:_AHEAD]))
            for i, page in enumerate(opened):
                status = page.start()  # the header, read ahead with the first layers
                if status is not None:
                    statuses[i] = status
                    fail()
                    return
            for k, (name, (off, n)) in enumerate(self.ranges.items()):
                if k + _AHEAD < len(layers):
                    for page in opened:
                        page.ahead(*layers[k + _AHEAD])
                for page in opened:
                    if reads.abandoned:
                        return
                    page.read(off, n)
                post(name)
            statuses = [page.finish() for page in opened]
            if any(s != "ok" for s in statuses):
                fail()
        except Exception as err:  # noqa: BLE001 - a tier must not take the engine down
            logger.warning("KVBM: layer-wise disk read failed: %s", err)
            statuses = ["error"] * len(reads.pages)
            fail()
        finally:
            for page in opened:
                page.close()
            reads.statuses = statuses

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        with self._cv:
            self._queue.append(None)
            self._cv.notify()
        self._thread.join(timeout=5.0)
