"""A step's stores copied layer by layer while its forward pass runs, on a
core vLLM keeps out of the forward pass.

On vLLM's CPU build a step's stores are otherwise copied after its forward
pass (``wait_for_save``, on the engine thread), so a miss's time to first
token includes them. vLLM calls ``save_kv_layer`` as each attention layer
returns, that layer's KV of the step written; where the process has a CPU
none of vLLM's OpenMP threads runs on (the core vLLM reserves:
``VLLM_CPU_NUM_OF_RESERVED_CPU``; cpus.spare_cpus), a copy thread pinned to
it copies each layer's part of the step's stores then, and ``wait_for_save``
waits only for what is left: the last layer's copy, and any layer vLLM did
not report (copied then). A store is reported exactly as before, in the
step that computed it. With every core bound to OpenMP there is no such core
and stores stay after the forward pass: a thread there would take a core
from it (docs/benchmarks.md). Models whose layers view shared memory
(vLLM's hybrid allocator) keep whole-block stores: a layer's bytes are not
its own.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import threading
import time

import numpy as np
import torch

from vllm_kvbm.cpus import name_os_thread, spare_cpus
from vllm_kvbm.messages import TransferJob, block_rows
from vllm_kvbm.worker.copy_runs import RegionTable, copy_runs
from vllm_kvbm.worker.kv_regions import BlockRegion, block_regions, checked_ids

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


class StepStores:
    """One step's stores copied by layer; a mover handle (``poll``)."""

    def __init__(self, jobs: list[TransferJob], blocks: np.ndarray, rows: np.ndarray):
        self.jobs = jobs
        self.job_ids = {id(job) for job in jobs}
        self.blocks, self.rows = blocks, rows
        self.started = time.perf_counter()
        self.layers: set[str] = set()  # posted
        self.left = 0  # layers posted and not copied yet
        self.failed: BaseException | None = None
        self.cond = threading.Condition()

    def poll(self) -> str:
        with self.cond:
            if self.left:
                return "PROC"
        return "ERR" if self.failed is not None else "DONE"

    def wait(self, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.left == 0, timeout)


class LayerStores:
    """The copy thread and the step being copied."""

    def __init__(self, tables: dict[str, RegionTable], mover, cpus: set[int]):
        self.tables, self.cpus = tables, cpus
        self.host_base, self.num_blocks, self.num_slots = (
            mover.host_base,
            mover.num_blocks,
            mover.num_slots,
        )
        self._step: StepStores | None = None
        self._meta: object = None  # the connector metadata _step was planned from
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvbm-layer-store", daemon=True)
        self._thread.start()

    @classmethod
    def start(
        cls, mover, kv_caches: dict[str, torch.Tensor], num_blocks: int, block_dims, hybrid: bool
    ) -> "LayerStores | None":
        """Layer-wise stores for this worker, or None (logged: why not)."""
        why = None
        tables = None
        from vllm_kvbm.worker.host_copies import HostCopies

        if hybrid or not isinstance(mover, HostCopies):
            why = "a hybrid model" if hybrid else f"copies by {mover.path}"
        else:
            tables = layer_tables(kv_caches, num_blocks, block_dims, mover.regions)
            why = None if tables else "layers view shared KV memory"
        cpus = spare_cpus() if tables else set()
        if tables and not cpus:
            why = "every core of this worker runs vLLM's OpenMP threads"
        if why is not None:
            logger.info("KVBM worker: stores copied after each forward pass (%s)", why)
            return None
        logger.info(
            "KVBM worker: stores copied layer by layer during the forward pass, on CPU %s "
            "(none of vLLM's OpenMP threads runs there)",
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
            self._post(step, name)

    def finish(self, meta) -> StepStores | None:
        """``wait_for_save``: the step's stores planned from ``meta`` (None if
        none were), every layer posted. The layers vLLM did not report, and
        those the copy thread has not started, are copied here, so what the
        caller then waits for (``StepStores.wait``) is the one copy that
        thread is in, whatever its core is doing."""
        step, self._step = self._step, None
        planned, self._meta = self._meta, None
        if step is None or planned is not meta:
            return None
        for name in self.tables:
            if name not in step.layers:
                self._post(step, name)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            _copy(*item)
        return step

    def _plan(self, jobs: list[TransferJob]) -> StepStores | None:
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
        return StepStores(
            kept, np.asarray(blocks, dtype=np.int64), np.asarray(rows, dtype=np.int64)
        )

    def _post(self, step: StepStores, name: str) -> None:
        src, dst, sizes = copy_runs(self.tables[name], self.host_base, step.blocks, step.rows, True)
        step.layers.add(name)
        with step.cond:
            step.left += 1
        self._queue.put((step, src.tolist(), dst.tolist(), sizes.tolist()))

    def _run(self) -> None:
        name_os_thread("kvbm-layer-copy")  # not an OpenMP thread to bench/cores.py
        try:
            os.sched_setaffinity(0, self.cpus)
        except (OSError, ValueError) as err:
            logger.debug("KVBM: layer store thread left on its CPUs: %s", err)
        while (item := self._queue.get()) is not None:
            _copy(*item)

    def close(self) -> None:
        """Once no step is being copied (the worker waited for its stores)."""
        self._queue.put(None)
        self._thread.join(timeout=5.0)


def _copy(step: StepStores, src: list[int], dst: list[int], sizes: list[int]) -> None:
    """One layer's copies of a step (on the copy thread, or the engine's)."""
    try:
        for s, d, n in zip(src, dst, sizes):
            _memmove(d, s, n)
    except BaseException as err:  # noqa: BLE001 - the step's stores fail, nothing else
        step.failed = err
    with step.cond:
        step.left -= 1
        if step.left == 0:
            step.cond.notify_all()
