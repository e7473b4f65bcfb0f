"""Layer-wise copies, the worker's side: stores posted as vLLM reports each
layer written, layered loads (host hits, and disk hits read layer by layer)
started before the forward pass and waited for layer by layer, and both
ended after it (layer_copies.py and layer_reads.py say how)."""

from __future__ import annotations

import logging
import time

from vllm_kvbm.io_threads import where_threads_are
from vllm_kvbm.messages import KVBMConnectorMetadata, TransferJob
from vllm_kvbm.worker import lora_loads
from vllm_kvbm.worker import layer_reads
from vllm_kvbm.worker.layer_reads import LayerReader, StepReads, layer_ranges

logger = logging.getLogger(__name__)


class LayeredSteps:
    """Part of ``KVBMWorker`` (worker.py, which holds the state): layer-wise copies."""

    @property
    def copies_by_layer(self) -> bool:
        return self._layer_copies is not None

    def save_layer(self, layer_name: str, meta: KVBMConnectorMetadata) -> None:
        """vLLM's ``save_kv_layer``: the layer's KV of this step is written."""
        if self._layer_copies is not None:
            self._layer_copies.layer_saved(layer_name, meta, self._storable)

    def _storable(self, meta: KVBMConnectorMetadata) -> list[TransferJob]:
        """The step's stores ``start_stores`` will copy (what ``_refused``
        and a released KV cache leave), found without failing any."""
        if self.kv_released is not None or not self.weights.serves(meta.weights):
            return []
        return [j for j in meta.stores if not j.refuse and not lora_loads.refuses(j.adapter)]

    def _start_layered(self, jobs: list[TransferJob]) -> None:
        """Synchronous host-tier loads (their disk pages read layer by layer
        too), copied layer by layer as the forward pass reaches each layer;
        failed (vLLM recomputes their blocks) where this worker cannot."""
        refused = jobs
        if self._layer_copies is not None and self.kv_released is None and not self._layered_off:
            reader = None if self._reads_off else self._layer_reader
            refused = []
            if reader is None:  # disk pages sent before the scheduler knew: failed
                refused = [job for job in jobs if job.fetch]
                jobs = [job for job in jobs if not job.fetch]
            refused += self._layer_copies.load(jobs, reader)
        for job in refused:
            self._complete(job, False, ok=False, started=time.perf_counter())

    def wait_layer(self, layer_name: str) -> None:
        """vLLM's ``wait_for_layer_load``: the layer's loads of this step are in."""
        if self._layer_copies is not None:
            self._layer_copies.layer_needed(layer_name)

    def _end_layered(self) -> None:
        """After the forward pass: the step's layered loads reported (in
        ``loads_done``). One whose layers were not all waited for before
        their attention ran failed: vLLM recomputes its blocks and drops the
        step's token for the request; this worker loads no more layer by
        layer. Loads with pages read in the step fail as their reads say."""
        ended = self._layer_copies.loads_ended() if self._layer_copies is not None else []
        late = sorted({name for step, waited in ended for name in step.layers - step.waited})
        if late and not self._layered_off:
            logger.error(
                "KVBM: layers %s ran attention without waiting for their loads; those "
                "requests are recomputed, and host-tier hits are loaded before the step "
                "from now on",
                late,
            )
            self._meta.layered_workers -= 1
            self._layered_off = True
        # What a layered load cost its request: the forward pass's waits for
        # the step's loads, every lane's (the step waited for them all).
        started = time.perf_counter() - sum(step.wait_s for step, _ in ended)
        for step, waited in ended:
            failed = set() if step.reads is None else self._reads_done(step)
            for job in step.jobs:
                ok = waited and step.failed is None and id(job) not in failed
                self._complete(job, False, ok=ok, started=started)

    # ---- disk and peer hits read layer by layer (layer_reads.py) ---------

    def _start_layer_reads(self, store) -> None:
        """A tier whose pages can be read layer by layer (the disk's, a
        peer's): its hits are, while this worker copies loads by layer."""
        if self._layer_reader is not None or not (
            hasattr(store, "open_slices") or hasattr(store, "open_layers")
        ):
            return
        if self._layer_copies is None or not self.layered_loads:
            return
        if self.info.page_blocks != 1:
            # a page of several blocks holds each layer in several ranges:
            # read layer by layer, its bytes would not arrive in order
            logger.info(
                "KVBM worker: disk and peer hits read before the step (pages of several blocks)"
            )
            return
        ranges = layer_ranges(self._layer_copies.tables)
        if ranges is None:
            logger.info(
                "KVBM worker: disk and peer hits read before the step (layers not in row order)"
            )
            return
        self._layer_reader = LayerReader(
            ranges, self._layer_copies.cpus, self.host_pool, self.tier_io.tiers
        )
        self._meta.layered_read_workers += 1
        logger.info("KVBM worker: disk and peer hits read layer by layer during the forward pass")

    def _reads_done(self, step) -> set[int]:
        """After the step's forward pass: its reads' outcomes reported; the
        ids of its jobs that failed. Reads still running (past their
        deadline) keep their slots from the host tier until they end, and
        layered reads stop for a while."""
        meta, rank, reads = self._meta, self.tier_io.rank, step.reads
        every = {id(job) for job in step.jobs}
        if self._layer_reader.hold(reads):
            self._reads_stuck += 1
            meta.slots_held.update(reads.slots())
        tiers = "/".join(sorted({tier for _, tier, _, _ in reads.pages}))
        if reads.held or reads.abandoned:
            for _, tier, _, _ in reads.pages:
                meta.tier_events[(tier, "error", rank)] += 1
            paused = self._pause_reads(
                f"reading {len(reads.pages)} {tiers} pages layer by layer missed its "
                f"deadline ({reads.deadline - reads.started:.2f} s)"
            )
            if reads.held and paused:  # once a pause: what the read still waits in
                where = where_threads_are(("kvbm-layer-read",))
                logger.warning("KVBM: the layer read thread at that moment: %s", where)
            if not reads.held:
                self._report_bad(reads)  # ended: what it found is final (else when it ends)
            return every
        if "error" in reads.statuses:
            # a tier that cannot be read now (a peer down, an I/O error) would
            # fail the next steps' layered loads too, each dropping a token:
            # read before the step meanwhile, where a failure only recomputes
            self._pause_reads(f"reading {tiers} pages layer by layer failed")
        for (_, tier, _, _), status in zip(reads.pages, reads.statuses):
            if status != "skipped":
                meta.tier_events[(tier, status, rank)] += 1
        self._report_bad(reads)
        meta.tier_read_seconds.append((reads.pages[0][1], reads.seconds))
        if not reads.failed:
            return set()
        bad = {id(job) for (job, _, _, _), s in zip(reads.pages, reads.statuses) if s != "ok"}
        if bad and step.layers == set(self._layer_copies.tables):
            return bad  # every layer copied, then a page found bad: its load alone fails
        return every

    def _report_bad(self, reads: StepReads) -> None:
        """The pages ``reads`` found unusable, for the scheduler to forget."""
        bad = [
            (tier, key)
            for (_, tier, key, _), status in zip(reads.pages, reads.statuses)
            if status not in ("ok", "skipped")
        ]
        if bad:
            logger.warning(
                "KVBM: %d of %d %s pages read layer by layer unusable; vLLM recomputes "
                "the loads that hold them",
                len(bad),
                len(reads.pages),
                "/".join(sorted({tier for tier, _ in bad})),
            )
            self._meta.bad_pages.extend(bad)

    def _pause_reads(self, why: str) -> bool:
        """Disk and peer hits read before the step for READS_BACK_AFTER_S;
        whether this paused them (they were not paused already)."""
        self._reads_back_at = time.monotonic() + layer_reads.READS_BACK_AFTER_S
        if self._reads_off:
            return False
        self._reads_off = True
        self._meta.layered_read_workers -= 1
        logger.error(
            "KVBM: %s; vLLM recomputes them, and disk and peer hits are read before "
            "the step until those reads ended and %g s passed",
            why,
            layer_reads.READS_BACK_AFTER_S,
        )
        return True

    def _reads_ended_late(self) -> None:
        """Reads that ended after their deadline: their slots are free again;
        layered reads come back once none runs and the pause passed."""
        if self._layer_reader is None:
            return
        for reads in self._layer_reader.take_late():
            self._reads_stuck -= 1
            self._meta.slots_released.update(reads.slots())
            self._report_bad(reads)  # found bad after the step gave up on them
            self._reads_back_at = time.monotonic() + layer_reads.READS_BACK_AFTER_S
        if self._reads_off and not self._reads_stuck and time.monotonic() >= self._reads_back_at:
            self._reads_off = False
            self._meta.layered_read_workers += 1
            logger.warning("KVBM: disk and peer hits are read layer by layer again")

    def _peer_reads_in_place(self) -> None:
        """Peer hits are read layer by layer only into host slots the peer
        tier registered (on its read thread, after startup): said once it
        did. Where registration failed, every layered peer read would fail
        its step; such hits load before the step instead."""
        if self._peer_in_place or self._layer_reader is None:
            return
        if getattr(self.tier_io.tiers.get("peer"), "reads_in_place", False):
            self._peer_in_place = True
            self._meta.layered_peer_workers += 1

    def _close_layer_reads(self) -> bool:
        """Stops the read thread; False while a read may still write host memory."""
        reader, self._layer_reader = self._layer_reader, None
        if reader is None:
            return True
        reader.close()
        return not reader.running
