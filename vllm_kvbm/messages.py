"""What the scheduler side tells the worker side each step, and back.

Shared by both sides, so it imports without vLLM too: the worker side runs on
machines with only PyTorch and NIXL (benchmarks/gpu_check.py), where the
messages derive from plain base classes instead of vLLM's.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
    )
except ImportError:  # no vLLM: the worker side on its own

    class KVConnectorMetadata:  # type: ignore[no-redef]
        """Stands in for vLLM's base class of the scheduler's per-step metadata."""

    class KVConnectorWorkerMetadata:  # type: ignore[no-redef]
        """Stands in for vLLM's base class of a worker's per-step metadata."""


# Sentinels inside a job's lists of ids. A job's slots and block ids stay
# aligned by index (page i is slots[i] and block_ids[i*G:(i+1)*G]), which
# block_rows, the worker's streaming and the per-page fetch indexes rely on,
# so an exception to one entry is marked in place rather than by a list of
# its own. Both are negative, as no slot or block id is: the worker filters
# them out before a copy, and one that slipped through would be refused by
# PageMover's bounds check, never read as slot or block -1 (the last one).
#
# STREAM, in slots: a lower-tier page that no host slot was free for; the
# worker streams it through staging slots of its own (worker/streaming.py).
STREAM = -2
# SKIP, in block_ids: a block of a page that is not copied; a load's first
# page may begin with blocks vLLM's own prefix cache already holds.
SKIP = -1


@dataclass
class TransferJob:
    """Copy pages between engine blocks and host-tier slots: page ``i`` is
    slot ``slots[i]`` and engine blocks ``block_ids[i*G:(i+1)*G]``, G blocks
    per page (SKIP: that block is not copied)."""

    job_id: int
    req_id: str
    block_ids: list[int]
    slots: list[int]
    # Loads only: pages to fetch from a lower tier into their host slot first
    # (or, with slot STREAM, through the worker's staging slots), as (index
    # into slots, tier name, page key).
    fetch: list[tuple[int, str, bytes]] = field(default_factory=list)
    # Loads only: seconds recomputing pages i.. of the job costs, for each i
    # (empty: not known). A fetch whose progress says it ends later than that
    # is cut at the pages landed (tier_io.py).
    recompute_s: list[float] = field(default_factory=list)
    # (LoRA int id, fingerprint) the job's keys name; None: no adapter. A
    # worker that loaded other weights for that id refuses the job
    # (worker/lora_loads.py).
    adapter: tuple[int, str] | None = None
    # Stores only: a hybrid model's sliding-window and state blocks, which
    # vLLM frees and hands out again as the request moves on: the worker
    # finishes copying them before the next step runs.
    before_next_step: bool = False
    # Loads only: the blocks vLLM allocated do not match what the lookup
    # found (scheduler/group_pages.py): fails without copying, recomputed.
    refuse: bool = False
    # Loads only: the control endpoint of the peer whose pool its "peer"
    # pages are read from (the request's hint; "" when it has none).
    peer: str = ""
    # Loads only: a host-tier hit vLLM was told is synchronous, copied layer
    # by layer during the step's forward pass (worker/layer_copies.py; its
    # ``fetch`` pages, disk pages, read layer by layer: layer_reads.py) and
    # reported in ``loads_done``, never as vLLM's finished_recving.
    layered: bool = False

    @property
    def page_blocks(self) -> int:
        return len(self.block_ids) // len(self.slots) if self.slots else 1

    def page_range(self, job_id: int, start: int, end: int) -> "TransferJob":
        """The copy of pages [start, end) alone, as job ``job_id`` (nothing to fetch)."""
        g = self.page_blocks
        return TransferJob(
            job_id, self.req_id, self.block_ids[start * g : end * g], self.slots[start:end]
        )

    @property
    def num_blocks(self) -> int:
        """Engine blocks the job copies."""
        return len(self.block_ids) - self.block_ids.count(SKIP)


def block_rows(job: TransferJob) -> tuple[list[int], list[int]]:
    """The job's copies as (engine block, host-pool row of one block) pairs,
    a page's G blocks being rows slot*G .. slot*G+G-1."""
    g = job.page_blocks
    if g == 1 and SKIP not in job.block_ids:
        return job.block_ids, job.slots
    blocks, rows = [], []
    for i, slot in enumerate(job.slots):
        for j, block in enumerate(job.block_ids[i * g : (i + 1) * g]):
            if block != SKIP:
                blocks.append(block)
                rows.append(slot * g + j)
    return blocks, rows


@dataclass
class SpillJob:
    """Write-through of ready host slots to lower tiers (disk, remote): the
    pages of one store or load that go to the same tiers, in one job (a job
    per page cost the scheduler more than the rest of its bookkeeping)."""

    job_id: int
    keys: list[bytes]
    slots: list[int]
    tiers: list[str]


@dataclass
class KVBMConnectorMetadata(KVConnectorMetadata):
    # host -> engine, started before the forward pass
    loads: list[TransferJob] = field(default_factory=list)
    # engine -> host, started after the forward pass computed the blocks
    stores: list[TransferJob] = field(default_factory=list)
    # preempted requests: their blocks are about to be reused, so their
    # in-flight stores must finish before the forward pass
    flush_req_ids: list[str] = field(default_factory=list)
    # finished requests whose blocks stay allocated until their stores finish;
    # the worker reports each one in finished_sending when that happens
    delayed_free_req_ids: list[str] = field(default_factory=list)
    # host slots to copy down to the disk / remote tiers
    spills: list[SpillJob] = field(default_factory=list)
    # (weights epoch, label per TP rank) the jobs' keys name: a worker whose
    # weights differ refuses them (worker/loaded_weights.py); None: none yet
    weights: tuple[int, tuple[str, ...]] | None = None


@dataclass
class KVBMWorkerMetadata(KVConnectorWorkerMetadata):
    """Per-step results of one worker, summed over workers by vLLM."""

    # job id -> number of workers that finished it (successfully or not)
    stores_done: Counter = field(default_factory=Counter)
    stores_failed: Counter = field(default_factory=Counter)
    # req id -> number of workers whose load for it failed
    loads_failed: Counter = field(default_factory=Counter)
    # req id -> number of workers that finished its layered load (ok or not),
    # and the longest any worker's forward pass waited for it (seconds)
    loads_done: Counter = field(default_factory=Counter)
    layered_waits: dict[str, float] = field(default_factory=dict)
    # workers that load layer by layer: +1 from each once it can, -1 once it
    # stopped (the scheduler asks for layered loads while every worker can)
    layered_workers: int = 0
    # workers that read disk hits layer by layer (worker/layer_reads.py), the same way
    layered_read_workers: int = 0
    # workers whose peer tier reads into the host tier's slots in place (its
    # memory registered with the reader's NIXL agent): peer hits are read
    # layer by layer only while every worker does (+1 once, never -1)
    layered_peer_workers: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    # spill job id -> workers that copied the slot (the slot may be reused)
    spills_done: Counter = field(default_factory=Counter)
    # (tier, outcome, TP rank) -> pages: fetch outcomes ("ok", "miss",
    # "corrupt", "unauthenticated", "error") and spill outcomes ("stored",
    # "refused", "dropped": the tier's write queue was full)
    tier_events: Counter = field(default_factory=Counter)
    # (tier, key) of pages a tier took (its write-through done), for KV events
    tier_stored: list[tuple[str, bytes]] = field(default_factory=list)
    # (tier, key) of pages found missing, corrupt or unauthenticated (removed)
    bad_pages: list[tuple[str, bytes]] = field(default_factory=list)
    # (tier, key) of pages a tier deleted on its own (its LRU), or whose write
    # was dropped (write queue full): may be written again
    removed_pages: list[tuple[str, bytes]] = field(default_factory=list)
    # seconds from post to completion, one entry per transfer
    store_latencies: list[float] = field(default_factory=list)
    load_latencies: list[float] = field(default_factory=list)
    # (tier, seconds): one load's reads from a lower tier, one page's write
    tier_read_seconds: list[tuple[str, float]] = field(default_factory=list)
    tier_write_seconds: list[tuple[str, float]] = field(default_factory=list)
    # (tier, TP rank) -> (bytes used, capacity) of a store that counts them,
    # when it changed
    tier_usage: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)
    # (tier, TP rank) -> what a store counts of itself (TierStore.counts),
    # when it changed
    tier_counts: dict[tuple[str, int], dict[str, int]] = field(default_factory=dict)
    # transfers past their timeout, by event (metric_names.TIMEOUT_EVENTS);
    # host slots that an overdue store may still write (each once per
    # worker), and those it no longer can
    transfer_timeouts: Counter = field(default_factory=Counter)
    slots_held: Counter = field(default_factory=Counter)
    slots_released: Counter = field(default_factory=Counter)
    # (req id, pages landed) of loads cut for running late, per worker: the
    # pages from there on are load errors, recomputed by vLLM
    loads_cut: list[tuple[str, int]] = field(default_factory=list)
    # (LoRA int id, fingerprint of the files read) of each adapter vLLM
    # loaded since the last report, per worker (worker/lora_loads.py)
    adapters_loaded: list[tuple[int, str]] = field(default_factory=list)
    # (weights epoch, TP rank, label) of each label a worker took since the
    # last report: a change, an epoch's check; epoch + 1: the label a change
    # earned from the next epoch on (worker/loaded_weights.py)
    weights_digested: list[tuple[int, int, str]] = field(default_factory=list)
    # the rank-0 endpoint peers read this engine's pool at, said once by TP
    # rank 0's worker ("": not served; None: nothing said)
    pool_served_at: str | None = None

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVBMWorkerMetadata":
        assert isinstance(other, KVBMWorkerMetadata)
        return KVBMWorkerMetadata(
            stores_done=self.stores_done + other.stores_done,
            stores_failed=self.stores_failed + other.stores_failed,
            loads_failed=self.loads_failed + other.loads_failed,
            loads_done=self.loads_done + other.loads_done,
            layered_waits={
                r: max(self.layered_waits.get(r, 0.0), other.layered_waits.get(r, 0.0))
                for r in self.layered_waits.keys() | other.layered_waits.keys()
            },
            layered_workers=self.layered_workers + other.layered_workers,
            layered_read_workers=self.layered_read_workers + other.layered_read_workers,
            layered_peer_workers=self.layered_peer_workers + other.layered_peer_workers,
            spills_done=self.spills_done + other.spills_done,
            tier_events=self.tier_events + other.tier_events,
            tier_stored=self.tier_stored + other.tier_stored,
            bad_pages=self.bad_pages + other.bad_pages,
            removed_pages=self.removed_pages + other.removed_pages,
            bytes_stored=self.bytes_stored + other.bytes_stored,
            bytes_loaded=self.bytes_loaded + other.bytes_loaded,
            store_latencies=self.store_latencies + other.store_latencies,
            load_latencies=self.load_latencies + other.load_latencies,
            tier_read_seconds=self.tier_read_seconds + other.tier_read_seconds,
            tier_write_seconds=self.tier_write_seconds + other.tier_write_seconds,
            tier_usage={**self.tier_usage, **other.tier_usage},
            tier_counts={**self.tier_counts, **other.tier_counts},
            transfer_timeouts=self.transfer_timeouts + other.transfer_timeouts,
            slots_held=self.slots_held + other.slots_held,
            slots_released=self.slots_released + other.slots_released,
            loads_cut=self.loads_cut + other.loads_cut,
            adapters_loaded=self.adapters_loaded + other.adapters_loaded,
            weights_digested=self.weights_digested + other.weights_digested,
            pool_served_at=(
                self.pool_served_at if self.pool_served_at is not None else other.pool_served_at
            ),
        )

    def is_empty(self) -> bool:
        return not (
            self.stores_done
            or self.stores_failed
            or self.loads_failed
            or self.loads_done
            or self.layered_workers
            or self.layered_read_workers
            or self.layered_peer_workers
            or self.spills_done
            or self.tier_events
            or self.transfer_timeouts
            or self.slots_held
            or self.slots_released
            or self.removed_pages
            or self.loads_cut
            or self.adapters_loaded
            or self.weights_digested
            or self.tier_read_seconds
            or self.tier_write_seconds
            or self.tier_usage
            or self.tier_counts
            or self.pool_served_at is not None
        )
