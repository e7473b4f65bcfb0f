"""Streamed loads, the worker's side: a load with more lower-tier pages than
free host slots goes through the staging slots a chunk at a time
(streaming.py says how); the slots an overdue fetch may still write are held
back until its reads end."""

from __future__ import annotations

import logging
import time

from vllm_kvbm.messages import STREAM, TransferJob
from vllm_kvbm.worker.fence import StepFence
from vllm_kvbm.worker.streaming import StreamedLoad, part

logger = logging.getLogger(__name__)


class StreamedLoads:
    """Part of ``KVBMWorker`` (worker.py, which holds the state): streamed
    loads and the slots of overdue fetches."""

    def _start_streamed(self, job: TransferJob, fence: StepFence) -> None:
        load = StreamedLoad(
            job, fence, time.perf_counter(), fetch={i: (tier, key) for i, tier, key in job.fetch}
        )
        in_host = []
        for i, slot in enumerate(job.slots):
            (load.pending if slot == STREAM else in_host).append(i)
        if in_host:  # host hits and promotions: as any load
            self._start_part(load, part(load, next(self._part_ids), in_host))
        self._feed(load)

    def _start_part(self, load: StreamedLoad, sub: TransferJob) -> None:
        self._parts[sub.job_id] = load
        load.running += 1
        self._start_load(sub, load.fence)

    def _feed(self, load: StreamedLoad) -> None:
        """Starts the next chunks of ``load`` that free staging slots allow
        (half the staging slots each, so two chunks overlap)."""
        assert self._staging is not None
        chunk = max(1, self._staging.count // 2)
        while load.ok and load.pending and self._staging.free:
            slots = self._staging.take(min(chunk, len(load.pending)))
            indexes, load.pending = load.pending[: len(slots)], load.pending[len(slots) :]
            self._start_part(load, part(load, next(self._part_ids), indexes, slots))
            load.waiting_since = None  # got slots: its deadline starts again
        waiting = load.ok and load.pending
        if waiting:
            if load.waiting_since is None:
                load.waiting_since = time.perf_counter()
            if load not in self._streams_waiting:
                self._streams_waiting.append(load)
        elif load in self._streams_waiting:
            self._streams_waiting.remove(load)

    def _expire_waiting_streams(self) -> None:
        """A streamed load that got no staging slot for tier_read_timeout_s
        fails (vLLM recomputes it): the slots may be held by reads stuck on a
        frozen filesystem, and its pages need not be on that tier at all."""
        if not self._streams_waiting:
            return
        limit = self.tier_io.read_timeout_s
        now = time.perf_counter()
        for load in list(self._streams_waiting):
            if load.waiting_since is None or now - load.waiting_since <= limit:
                continue
            logger.error(
                "KVBM: streamed load of %d pages for %s got no staging slot for "
                "%g s (tier_read_timeout_s); vLLM recomputes it",
                len(load.pending),
                load.job.req_id,
                limit,
            )
            self._meta.transfer_timeouts["no_staging_slot"] += 1
            load.ok, load.pending = False, []
            self._streams_waiting.remove(load)
            if load.done:
                self._complete(load.job, False, ok=False, started=load.started)

    def _hold_read_slots(self, job: TransferJob, hold: bool) -> None:
        """An overdue fetch failed, but its reads may still write the slots
        it fetches into: host slots are held from the host tier (as an
        overdue store's), staging slots kept from the next chunk, until the
        reads end (``hold`` False: they did)."""
        slots = {job.slots[i] for i, _, _ in job.fetch}
        host = [s for s in slots if s < self.num_host_slots]
        staging = slots - set(host)
        if hold:
            self._meta.slots_held.update(host)
            self._staging_reading |= staging
            return
        self._meta.slots_released.update(host)
        if staging:
            assert self._staging is not None
            self._staging_reading -= staging
            self._staging.give(sorted(staging))
            self._feed_streams()

    def _part_done(self, load: StreamedLoad, sub: TransferJob, ok: bool) -> None:
        assert self._staging is not None
        self._staging.give([s for s in sub.slots if s not in self._staging_reading])
        load.running -= 1
        load.ok &= ok
        if load.done:
            self._complete(load.job, False, ok=load.ok, started=load.started)
        self._feed_streams(load)

    def _feed_streams(self, *first: StreamedLoad) -> None:
        """Staging slots came free: ``first``'s next chunks, then the waiting
        loads' (a done load leaves the waiting list in _feed)."""
        for load in [*first, *self._streams_waiting]:
            self._feed(load)
