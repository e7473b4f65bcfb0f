"""Loads whose lower-tier pages are still being read: the pages landed so far
are copied into the engine meanwhile.

A fetch reads a group of pages at a time (tier_fetches.py), each checked in
its host slot as it lands. Each step, the pages at the start of the job that
have landed and are not copied yet are posted as a copy of their own (behind
the load's step fence, as the whole job would be), so their copy into the
engine's blocks runs while the tier reads the pages after them: a disk or
remote hit costs its read and the copy of its last group, not its read and
then the copy of every page. A landed page never changes (its slot is the
job's until the job is reported). The load is reported once its fetch ended
and every copy of it did: failed when the fetch failed (all its blocks are
recomputed, those copied early included), cut where the fetch was cut.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_kvbm.messages import TransferJob
from vllm_kvbm.worker.fence import StepFence


@dataclass(eq=False)
class EarlyLoad:
    """A load some of whose pages were copied before its fetch ended."""

    job: TransferJob
    started: float
    copied: int = 0  # pages [0, copied) posted
    running: int = 0  # copies posted and not ended
    ok: bool = True
    fetched: bool = False  # the fetch ended: the rest is posted, nothing after

    @property
    def done(self) -> bool:
        return self.fetched and self.running == 0


class EarlyCopies:
    """Part of ``KVBMWorker`` (worker.py, which holds the state): copies of a
    fetch's landed pages while it reads the rest."""

    def _copy_landed(self) -> None:
        """Posts, for each running fetch, its landed pages not copied yet."""
        if not self._fetching:
            return
        for job, landed in self.tier_io.landed():
            if job.job_id not in self._fetching:
                continue  # not this worker's load
            fence, queued = self._fetching[job.job_id]
            early = self._early.get(job.job_id)
            if landed <= (early.copied if early else 0):
                continue
            if early is None:
                early = self._early[job.job_id] = EarlyLoad(job, queued)
            self._post_early(early, landed, fence)

    def _post_early(self, early: EarlyLoad, end: int, fence: StepFence) -> None:
        sub = early.job.page_range(next(self._part_ids), early.copied, end)
        early.copied = end
        early.running += 1
        self._early_parts[sub.job_id] = early
        self._queue(sub, False, fence)

    def _fetched_early(self, job: TransferJob, ok: bool, cut: int | None, fence: StepFence) -> bool:
        """The fetch of ``job`` ended (``ok``; cut after ``cut`` pages when
        not None). False when none of its pages was copied early (the
        caller loads it whole); else its other pages are posted now and the
        load is reported when its copies end."""
        early = self._early.pop(job.job_id, None)
        if early is None:
            return False
        early.fetched = True
        if not ok:
            early.ok = False
        else:
            if cut is not None:
                # cut at the pages landed, of which the copied ones are the first
                assert cut >= early.copied > 0, (cut, early.copied)
                rest = self._cut_load(job, cut)
                assert rest is not None
                early.job = rest
            if len(early.job.slots) > early.copied:
                self._post_early(early, len(early.job.slots), fence)
        self._early_done(early)
        return True

    def _early_part_done(self, job: TransferJob, ok: bool) -> bool:
        """``job`` is a copy of an early load's pages: noted (True)."""
        early = self._early_parts.pop(job.job_id, None)
        if early is None:
            return False
        early.running -= 1
        early.ok &= ok
        self._early_done(early)
        return True

    def _early_done(self, early: EarlyLoad) -> None:
        if early.done:
            self._complete(early.job, False, ok=early.ok, started=early.started)
