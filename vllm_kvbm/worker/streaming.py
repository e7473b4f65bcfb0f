"""Loads longer than the host tier: lower-tier pages streamed through staging slots.

The scheduler promotes a load's disk and remote pages into free host slots;
pages for which no slot is free come with slot ``STREAM``. The worker moves
those through a few staging slots of its own (rows after the host tier's in
the same registered pool), a chunk at a time: fetch into staging, NIXL into
the engine blocks, free the staging slots, next chunk. Two chunks run at
once when the staging slots allow, so a fetch overlaps the previous copy.
The request's load is done when every part is; one failed part fails it
(vLLM recomputes), after the parts still running have ended.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm_kvbm.messages import STREAM, TransferJob

if TYPE_CHECKING:
    from vllm_kvbm.worker.fence import StepFence

# Staging memory per worker: at most this many bytes, and 2 to 32 slots.
STAGING_BYTES = 128 << 20
_MAX_STAGING_SLOTS = 32


def staging_slots(page_bytes: int) -> int:
    return max(2, min(_MAX_STAGING_SLOTS, STAGING_BYTES // max(page_bytes, 1)))


class StagingSlots:
    """The free staging slots (host-pool rows ``first`` .. ``first + count - 1``)."""

    def __init__(self, first: int, count: int):
        self.first, self.count = first, count
        self._free = list(range(first + count - 1, first - 1, -1))

    def take(self, n: int) -> list[int]:
        n = min(n, len(self._free))
        taken, self._free = self._free[len(self._free) - n :], self._free[: len(self._free) - n]
        return taken

    def give(self, slots: list[int]) -> None:
        self._free += [s for s in slots if self.first <= s < self.first + self.count]

    @property
    def free(self) -> int:
        return len(self._free)


@dataclass(eq=False)
class StreamedLoad:
    """A load with streamed pages: its parts still to start and running."""

    job: TransferJob
    fence: "StepFence"
    started: float
    pending: list[int] = field(default_factory=list)  # indexes of pages to stream
    # the job's fetches by index, read once for all its parts
    fetch: dict[int, tuple[str, bytes]] = field(default_factory=dict)
    running: int = 0
    ok: bool = True
    # when it last waited for staging slots without getting any (None: not
    # waiting): past tier_read_timeout_s it fails, so vLLM recomputes
    waiting_since: float | None = None

    @property
    def done(self) -> bool:
        return self.running == 0 and (not self.pending or not self.ok)


def needs_streaming(job: TransferJob) -> bool:
    return any(job.slots[i] == STREAM for i, _, _ in job.fetch)


def part(
    load: StreamedLoad, part_id: int, indexes: list[int], slots: list[int] | None = None
) -> TransferJob:
    """The sub-job of ``load``'s job for pages ``indexes``, in ``slots``
    (default: theirs)."""
    job, fetch = load.job, load.fetch
    g = job.page_blocks
    sub = TransferJob(
        part_id,
        job.req_id,
        [b for i in indexes for b in job.block_ids[i * g : (i + 1) * g]],
        slots if slots is not None else [job.slots[i] for i in indexes],
    )
    sub.fetch = [(p, *fetch[i]) for p, i in enumerate(indexes) if i in fetch]
    sub.peer = job.peer
    return sub
