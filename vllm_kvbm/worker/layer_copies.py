"""A step's copies between the KV cache and the host tier made layer by layer
while its forward pass runs, on a core vLLM keeps out of the forward pass.

On vLLM's CPU build a step's copies otherwise run on the engine thread around
its forward pass: stores after it (``wait_for_save``), so a miss's time to
first token includes them; loads before the step that computes the request
(which waits in WAITING_FOR_REMOTE_KVS meanwhile), so a hit's does. Where the
process has a CPU none of vLLM's OpenMP threads runs on (the core vLLM
reserves: ``VLLM_CPU_NUM_OF_RESERVED_CPU``; cpus.spare_cpus), a copy thread
pinned to it does them layer by layer instead:

- stores: vLLM calls ``save_kv_layer`` as each attention layer returns, that
  layer's KV of the step written; its part of the step's stores is copied
  then, and ``wait_for_save`` waits only for what is left (the last layer's
  copy, and any layer vLLM did not report, copied then). A store is reported
  in the step that computed it, as before.
- loads: a hit the host tier holds whole is returned to vLLM as synchronous
  (the scheduler asks for it once every worker said it can: ``layered``), so
  the request computes in the step that loads it. ``start_load_kv`` posts
  every layer's copy in order, and vLLM's ``wait_for_layer_load`` before each
  attention layer waits for that layer's only (copying itself the layers up
  to it the thread has not started). A layer whose attention ran without
  that wait fails its lane's loads (vLLM recomputes those blocks and drops
  the step's token for them) and ends layered loads for this worker. Hits
  with disk or peer pages are a lane of their own, posted a layer at a time
  as the read thread (layer_reads.py) brings that layer of every page into
  its host slot: a read that fails or runs late fails that lane's loads,
  never the host hits of the step; a page found bad after its last layer
  fails only its own request's load (vLLM recomputes it, and any request
  sharing its blocks).

The engine thread never waits for more than the one copy the thread is in
(loads are taken in layer order, whichever lane posted them).
With every core bound to OpenMP there is no such core and copies stay around
the forward pass: a thread there would take a core from it
(docs/benchmarks.md). Models whose layers view shared memory (vLLM's hybrid
allocator) keep whole-block copies: a layer's bytes are not its own.
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
import logging
import os
import threading
import time

import numpy as np
import torch

from vllm_kvbm.cpus import name_os_thread
from vllm_kvbm.messages import TransferJob, block_rows
from vllm_kvbm.worker.copy_runs import RegionTable, copy_runs
from vllm_kvbm.worker.host_copies import PIECE_BYTES, HostCopies, pieces
from vllm_kvbm.worker.kv_regions import BlockRegion, block_regions, checked_ids
from vllm_kvbm.worker.layer_reads import LayerReader, StepReads

logger = logging.getLogger(__name__)

_memmove = ctypes.memmove


def layer_tables(
    kv_caches: dict[str, torch.Tensor],
    num_blocks: int,
    block_dims: dict[str, int] | None,
    regions: list[BlockRegion],
) -> dict[str, RegionTable] | None:
    """Each layer's part of a block (its regions, at their offsets in a host
    row laid out as ``regions``); None where a region is viewed by several
    layers or a layer has none of its own."""
    index = {(r.base, r.stride): i for i, r in enumerate(regions)}
    sizes = [r.layer_block_bytes for r in regions]
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
    owner: dict[int, str] = {}
    tables = {}
    for name, t in kv_caches.items():
        mine = [
            index.get((r.base, r.stride)) for r in block_regions({name: t}, num_blocks, block_dims)
        ]
        if not mine or None in mine or any(i in owner for i in mine):
            return None
        owner.update((i, name) for i in mine)
        tables[name] = RegionTable.of([regions[i] for i in mine], offsets[mine], int(sum(sizes)))
    return tables if len(owner) == len(regions) else None


class StepCopies:
    """One step's stores (or loads) copied by layer; a mover handle (``poll``)."""

    def __init__(self, jobs: list[TransferJob], blocks: np.ndarray, rows: np.ndarray):
        self.jobs = jobs
        self.job_ids = {id(job) for job in jobs}
        self.blocks, self.rows = blocks, rows
        self.started = time.perf_counter()
        self.layers: set[str] = set()  # posted
        self.waited: set[str] = set()  # loads: layers vLLM waited for
        self.wait_s = 0.0  # loads: how long the forward pass waited for them
        self.parts: dict[str, int] = {}  # per layer posted: its copies not done yet
        self.failed: BaseException | None = None
        self.reads: StepReads | None = None  # loads: layer-wise disk reads (layer_reads.py)
        self.cond = threading.Condition()

    @property
    def left(self) -> int:
        """Copies posted and not done yet (read under ``cond``)."""
        return sum(self.parts.values())

    def copied(self, name: str) -> bool:
        """Layer ``name``'s copies are posted and done (read under ``cond``)."""
        return self.parts.get(name) == 0

    def poll(self) -> str:
        with self.cond:
            if self.left:
                return "PROC"
        return "ERR" if self.failed is not None else "DONE"

    def wait(self, timeout: float | None = None) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.left == 0, timeout)


class _Work:
    """The copies posted, loads first in vLLM's layer order (a read's layer
    posted late goes before the host hits' later layers), then stores in
    the order posted; the copy thread takes the first, the engine thread
    those it must not wait for."""

    def __init__(self) -> None:
        self._items: list = []  # a heap of (loads first, layer, posted, item)
        self._posted = itertools.count()
        self._cv = threading.Condition()

    def put(self, item, load: bool = False, layer: int = 0) -> None:
        """``item`` None: the thread ends once every copy before it is done."""
        key = (0, layer) if load else (1 if item is not None else 2, 0)
        with self._cv:
            heapq.heappush(self._items, (*key, next(self._posted), item))
            self._cv.notify()

    def get(self):
        with self._cv:
            self._cv.wait_for(lambda: self._items)
            return heapq.heappop(self._items)[-1]

    def take_if(self, wanted):
        """The first item if ``wanted(item)``, else None."""
        with self._cv:
            if self._items and self._items[0][-1] is not None and wanted(self._items[0][-1]):
                return heapq.heappop(self._items)[-1]
            return None


class LayerCopies:
    """The copy thread, and the step's stores and loads being copied."""

    def __init__(self, tables: dict[str, RegionTable], mover, cpus: set[int]):
        self.tables, self.cpus = tables, cpus
        self.host_base, self.num_blocks, self.num_slots = (
            mover.host_base,
            mover.num_blocks,
            mover.num_slots,
        )
        self.order = {name: i for i, name in enumerate(tables)}  # vLLM's layer order
        self._step: StepCopies | None = None  # stores
        self._meta: object = None  # the connector metadata _step was planned from
        self._loads: list[StepCopies] = []  # the step's lanes: host hits, hits read
        self._work = _Work()
        self._thread = threading.Thread(target=self._run, name="kvbm-layer-copy", daemon=True)
        self._thread.start()

    @classmethod
    def start(
        cls,
        mover,
        kv_caches: dict[str, torch.Tensor],
        num_blocks: int,
        block_dims,
        hybrid: bool,
        spare: "set[int] | frozenset[int]",
    ) -> "LayerCopies | None":
        """Layer-wise copies for this worker on the CPUs ``spare``
        (cpus.spare_cpus), or None (logged: why not)."""
        why = None
        tables = None
        if hybrid or not isinstance(mover, HostCopies):
            why = "a hybrid model" if hybrid else f"copies by {mover.path}"
        else:
            tables = layer_tables(kv_caches, num_blocks, block_dims, mover.regions)
            why = None if tables else "layers view shared KV memory"
        cpus = set(spare) if tables else set()
        if tables and not cpus:
            why = "every core of this worker runs vLLM's OpenMP threads"
        if why is not None:
            logger.info(
                "KVBM worker: stores copied after each forward pass, host hits loaded before "
                "it (%s)",
                why,
            )
            return None
        logger.info(
            "KVBM worker: stores and host hits copied layer by layer during the forward pass, "
            "on CPU %s (none of vLLM's OpenMP threads runs there)",
            ",".join(map(str, sorted(cpus))),
        )
        return cls(tables, mover, cpus)

    def layer_saved(self, name: str, meta, storable) -> None:
        """vLLM's ``save_kv_layer``: layer ``name``'s KV of this step is
        written. The step's stores (``storable(meta)``: those that will be
        copied) are planned at its first layer."""
        if meta is not self._meta:
            self._meta = meta
            self._step = self._plan(storable(meta))
        step = self._step
        if step is not None and name in self.tables and name not in step.layers:
            self._post(step, name, True)

    def finish(self, meta) -> StepCopies | None:
        """``wait_for_save``: the step's stores planned from ``meta`` (None if
        none were), every layer posted. The layers vLLM did not report, and
        those the copy thread has not started, are copied here, so what the
        caller then waits for (``StepCopies.wait``) is the one copy that
        thread is in, whatever its core is doing."""
        step, self._step = self._step, None
        planned, self._meta = self._meta, None
        if step is None or planned is not meta:
            return None
        for name in self.tables:
            if name not in step.layers:
                self._post(step, name, True)
        while (item := self._work.take_if(lambda it: it[0] is step)) is not None:
            _copy(*item)
        return step

    def load(
        self, jobs: list[TransferJob], reader: "LayerReader | None" = None
    ) -> list[TransferJob]:
        """``start_load_kv``: the step's layered loads, every layer's copy
        posted in vLLM's layer order; those with disk or peer pages to read
        (by ``reader``) in a lane of their own, each layer posted once it is
        read. The jobs refused (ids out of range)."""
        read = [job for job in jobs if job.fetch and reader is not None]
        host = self._plan([job for job in jobs if not (job.fetch and reader is not None)])
        step = self._plan(read)
        self._loads = [lane for lane in (host, step) if lane is not None]
        if host is not None:
            for name in self.tables:
                self._post(host, name, False)
        if step is not None:
            step.reads = reader.plan(step.jobs)
            reader.start(
                step.reads, lambda name: self._post(step, name, False), lambda: _fail(step)
            )
        planned = {i for lane in self._loads for i in lane.job_ids}
        return [job for job in jobs if id(job) not in planned]

    def layer_needed(self, name: str) -> None:
        """vLLM's ``wait_for_layer_load``: returns once layer ``name``'s loads
        are copied, copying here those up to it the thread has not started."""
        if name in self.tables:
            for step in self._loads:
                self._wait_layer(step, name)

    def _wait_layer(self, step: StepCopies, name: str) -> None:
        step.waited.add(name)
        started = time.perf_counter()
        last = self.order[name]
        reads = step.reads
        while True:
            while not step.copied(name):
                item = self._work.take_if(
                    lambda it: it[0] in self._loads and self.order[it[1]] <= last
                )
                if item is None:
                    break
                _copy(*item)
            with step.cond:
                if reads is None:
                    step.cond.wait_for(lambda: step.copied(name))
                    break
                # Posted once read: woken by the post, each copy and a failure.
                # A layer posted is copied even after a failure: the pages
                # found good keep their loads (layered_steps.py).
                if step.copied(name) or (reads.failed and name not in step.layers):
                    break
                left = reads.deadline - time.perf_counter()
                if left <= 0:
                    reads.abandoned = reads.failed = True  # the lane's loads fail
                    break
                step.cond.wait(left)
        step.wait_s += time.perf_counter() - started

    def loads_ended(self) -> list[tuple[StepCopies, bool]]:
        """After the forward pass: the step's load lanes, every copy ended,
        each with whether its layers were waited for before their attention."""
        lanes, self._loads = self._loads, []
        for step in lanes:
            reads = step.reads
            if reads is not None and not reads.ended.wait(
                max(0.0, reads.deadline - time.perf_counter())
            ):
                with step.cond:
                    reads.abandoned = reads.failed = True  # no layer posted from now on
        while (item := self._work.take_if(lambda it: it[0] in lanes)) is not None:
            _copy(*item)
        for step in lanes:
            step.wait()
        return [(step, step.waited >= step.layers) for step in lanes]

    def _plan(self, jobs: list[TransferJob]) -> StepCopies | None:
        """The jobs' copies; a job whose ids are out of range is left to the
        whole-block path (which refuses it before copying anything)."""
        kept, blocks, rows = [], [], []
        for job in jobs:
            b, r = block_rows(job)
            try:
                checked_ids(b, r, self.num_blocks, self.num_slots)
            except (ValueError, IndexError):
                continue
            kept.append(job)
            blocks += b
            rows += r
        if not kept:
            return None
        return StepCopies(
            kept, np.asarray(blocks, dtype=np.int64), np.asarray(rows, dtype=np.int64)
        )

    def _post(self, step: StepCopies, name: str, to_host: bool) -> None:
        """The layer's copies, as two halves: whoever waits for the layer
        takes the half the thread has not started."""
        table = self.tables[name]
        runs = copy_runs(table, self.host_base, step.blocks, step.rows, to_host)
        src, dst, sizes = pieces(*runs, PIECE_BYTES)
        half = (len(sizes) + 1) // 2
        items = [(a, b) for a, b in ((0, half), (half, len(sizes))) if b > a]
        with step.cond:
            if step.reads is not None and step.reads.abandoned:
                return  # read after the step gave up: its blocks are not written
            step.layers.add(name)
            step.parts[name] = len(items)
            step.cond.notify_all()
        for a, b in items:
            item = (step, name, src[a:b], dst[a:b], sizes[a:b])
            self._work.put(item, load=not to_host, layer=self.order[name])

    def _run(self) -> None:
        name_os_thread("kvbm-layer-copy")  # not an OpenMP thread to bench/cores.py
        try:
            os.sched_setaffinity(0, self.cpus)
        except (OSError, ValueError) as err:
            logger.debug("KVBM: layer store thread left on its CPUs: %s", err)
        while (item := self._work.get()) is not None:
            _copy(*item)

    def close(self) -> None:
        """Once no step is being copied (the worker waited for its stores)."""
        self._work.put(None)
        self._thread.join(timeout=5.0)


def _fail(step: StepCopies) -> None:
    """The step's disk reads cannot be used: its loads fail, no wait for them."""
    with step.cond:
        step.reads.failed = True
        step.cond.notify_all()


def _copy(step: StepCopies, name: str, src: list[int], dst: list[int], sizes: list[int]) -> None:
    """One layer's copies of a step (on the copy thread, or the engine's)."""
    try:
        for s, d, n in zip(src, dst, sizes):
            _memmove(d, s, n)
    except BaseException as err:  # noqa: BLE001 - the step's copies fail, nothing else
        step.failed = err
    with step.cond:
        step.parts[name] -= 1
        step.cond.notify_all()
