"""Store: the jobs that copy a request's computed pages into host slots, the
pages that wait for a free slot (backlogs), and the write-through (spills)
of stored pages to the lower tiers."""

from __future__ import annotations

from collections import Counter

from vllm_kvbm.keys import PageKey
from vllm_kvbm.messages import SpillJob, TransferJob
from vllm_kvbm.scheduler.request_state import _ReqState, _StoreJob

# A store backlog that gets no host slot for this long and this many steps
# is dropped (counted in store_skipped_blocks): a finished request's engine
# blocks are held for it. Steps too, as a long prefill step alone can take
# longer than the slots' round trip (store, spill, copied) of a few steps.
BACKLOG_TIMEOUT_S = 5.0
BACKLOG_TIMEOUT_STEPS = 20


class StorePlanning:
    """Part of ``KVBMScheduler`` (planner.py, which holds the state): stores."""

    def _plan_store(
        self, state: _ReqState, num_scheduled: int, states: dict[tuple[int, int], int] | None = None
    ) -> TransferJob | None:
        """Stores every full page this step completes that the host lacks
        (after the request's backlog); ``states``: a hybrid's state blocks
        vLLM handed off this step (GroupPages.boundary_states)."""
        request = state.request
        if (
            state.no_store
            or not state.params.stores
            or (
                not self.offload_decode_blocks
                and state.store.cursor >= request.num_prompt_tokens // self.page_tokens
            )
        ):
            return None  # e.g. decoding, prompt stored: the common case, kept cheap
        # Tokens whose KV exists after this step and whose ids are known.
        end = min(request.num_computed_tokens + num_scheduled, request.num_tokens)
        if not self.offload_decode_blocks:
            end = min(end, request.num_prompt_tokens)
        full = end // self.page_tokens
        cap = state.params.store_pages(self.page_tokens)  # max_offload_tokens
        if cap is not None:
            full = min(full, cap)
        if state.store.cursor >= full:
            return None  # no new full page: O(1), whatever the prompt's length
        # Only the new blocks are hashed and looked at (no copies of the
        # request's keys or block ids).
        state.chain.extend_to(request.all_token_ids, full)
        assert self._kv_cache_manager is not None
        start = state.store.cursor if state.store.backlog is None else state.store.backlog
        state.store.cursor = full
        return self._store_pages(state, start, full, states)

    def _drain_backlogs(self) -> list[TransferJob]:
        """Stores of backlogged pages, into the host slots freed since
        (spilled pages unpinned, so evictable): a prompt longer than the
        host tier reaches the lower tiers a host tier's worth at a time."""
        jobs = []
        for state in list(self._backlogged.values()):
            if state.no_store:  # e.g. its pages would get post-reset keys
                self._drop_backlog(state)
                continue
            job = self._store_pages(state, state.store.backlog, state.store.cursor)
            if job is not None:
                jobs.append(job)
        return jobs

    def _store_pages(
        self,
        state: _ReqState,
        start: int,
        full: int,
        states: dict[tuple[int, int], int] | None = None,
    ) -> TransferJob | None:
        """A store of pages [start, full) the host lacks, into the host slots
        free or evictable now. Pages that find none wait as the request's
        backlog when lower tiers exist (stored as slots come free, vLLM
        keeping a finished request's blocks meanwhile), else are skipped
        (a backlog's state pages too: vLLM handed their blocks off steps ago)."""
        if self.groups is not None:
            return self._store_group_pages(state, start, full, states)
        request, keys = state.request, state.chain.keys
        # Blocks the host has (stored, or being stored by another request)
        # are left out.
        positions, job_slots, stopped = self.host.allocate_missing(keys, start, full)
        self._note_backlog(state, stopped, progressed=bool(positions))
        if not positions:
            return None
        blocks = self._kv_cache_manager.get_blocks(request.request_id).blocks[0]
        job_keys = [keys[i] for i in positions]
        self.events.describe(request, keys, positions)
        g = self.page_blocks
        if g == 1:
            job_blocks = [blocks[i].block_id for i in positions]
        else:
            job_blocks = [b.block_id for i in positions for b in blocks[i * g : (i + 1) * g]]
        return self._store_job(state, job_keys, job_blocks, job_slots)

    def _store_job(
        self,
        state: _ReqState,
        keys: list[PageKey],
        blocks: list[int],
        slots: list[int],
        before_next_step: bool = False,
    ) -> TransferJob:
        job_id = next(self._job_ids)
        pinned = self._pin(blocks) if self.groups is not None else []
        self._store_jobs[job_id] = _StoreJob(
            state.request.request_id, keys, self.info.num_workers, pinned=pinned
        )
        state.store.jobs.add(job_id)
        return TransferJob(
            job_id,
            state.request.request_id,
            blocks,
            slots,
            adapter=state.adapter,
            before_next_step=before_next_step,
        )

    def _pin(self, block_ids: list[int]) -> list:
        """A hybrid store's blocks, held in vLLM's block pool (a reference,
        as vLLM's own offloading holds its stores' blocks) until every
        worker reported the store: vLLM frees window and state blocks as a
        request moves on, and a preempted request's, and the next step may
        zero them, copy into them or hand them out before the workers'
        ``handle_preemptions`` runs (Model Runner V2 zeroes and copies first)."""
        pool = self._kv_cache_manager.block_pool
        blocks = [pool.blocks[b] for b in block_ids if b > 0]
        pool.touch(blocks)
        return blocks

    def _store_group_pages(
        self, state: _ReqState, start: int, full: int, states: dict[tuple[int, int], int] | None
    ) -> TransferJob | None:
        """``_store_pages`` for a hybrid model: each group's pages of pages
        [start, full) that its hits read (scheduler/group_pages.py)."""
        request, keys = state.request, state.chain.keys
        blocks = self._kv_cache_manager.get_blocks(request.request_id).get_block_ids()
        units = self.groups.store_units(
            keys, range(start, full), blocks, request.num_prompt_tokens, states
        )
        unit_keys = [u.key for u in units]
        positions, job_slots, stopped = self.host.allocate_missing(unit_keys, 0, len(units))
        self._note_backlog(
            state, units[stopped].page if stopped < len(units) else full, progressed=bool(positions)
        )
        if not positions:
            return None
        primary = self.groups.primary
        self.events.describe(
            request, keys, [units[i].page for i in positions if units[i].group == primary]
        )
        return self._store_job(
            state,
            [unit_keys[i] for i in positions],
            [b for i in positions for b in units[i].blocks],
            job_slots,
            before_next_step=True,
        )

    def _finish_stores(self, counts: Counter, ok: bool) -> None:
        for job_id, n in counts.items():
            job = self._store_jobs.get(job_id)
            if job is None:
                continue
            job.pending_workers -= n
            job.failed |= not ok
            if job.pending_workers > 0:
                continue  # other TP ranks still copying their shard
            del self._store_jobs[job_id]
            if job.pinned:  # the workers read them no more
                self._kv_cache_manager.block_pool.free_blocks(job.pinned)
            state = self._reqs.get(job.req_id)
            if job.failed or job.stale:
                for key in job.keys:
                    self.host.drop(key)
            else:
                self.host.commit(job.keys)
                # the lower tiers the request allows (kv_store_tiers)
                self._spill_now(
                    job.keys, False, only=None if state is None else state.params.store_tiers
                )
            if job.failed:
                self.stats.add("store_errors")
            else:
                self.stats.add("offload_blocks_d2h", len(job.keys) * self.page_blocks)
            if state is not None:
                state.store.jobs.discard(job_id)
                self._maybe_forget(state)

    def _spill(self, keys: list[PageKey], reused: bool) -> None:
        """Write-through of ready host blocks to the lower tiers that admit
        them: one spill job per run of blocks going to the same tiers.
        Reused blocks the disk may hold already are first asked about on the
        lookup thread (a stat on a hung filesystem never blocks this one):
        spilled when it answers (``_spill_checked``)."""
        ask = self.lower.disk_unknown(keys) if reused else []
        if ask and self._background is not None:
            self._background.check_disk(ask, keys)
            return
        self._spill_now(keys, reused)

    def _spill_checked(self) -> None:
        if self._background is not None:
            for keys, on_disk in self._background.take_checked():
                self._spill_now(keys, True, on_disk)

    def _spill_now(
        self,
        keys: list[PageKey],
        reused: bool,
        on_disk: set[PageKey] | frozenset = frozenset(),
        only: frozenset[str] | None = None,
    ) -> None:
        for tiers, run in self.lower.admit(keys, reused, on_disk, only):
            run = [key for key in run if self.host.is_ready(key)]
            if not run:
                continue
            self.events.spilling(tiers, run)
            slots = self.host.pin(run)  # held until every worker copied them
            job = SpillJob(next(self._job_ids), run, slots, tiers)
            self._pending_spills[job.job_id] = [run, self.info.num_workers]
            self._spills.append(job)

    def _finish_spills(self, counts: Counter) -> None:
        copied = []
        for job_id, n in counts.items():
            pending = self._pending_spills.get(job_id)
            if pending is None:
                continue
            pending[1] -= n
            if pending[1] <= 0:
                del self._pending_spills[job_id]
                copied += pending[0]
        self.host.unpin(copied)

    def _note_backlog(self, state: _ReqState, stopped: int, progressed: bool) -> None:
        if stopped >= state.store.cursor:
            if state.store.backlog is not None:
                state.store.backlog = None
                self._backlog_done(state)
            return
        if not (self.lower and self.lower.writes_fresh_pages()):
            # No lower tier takes them now: a later store would only evict
            # this prompt's own pages from the host tier.
            self.stats.add(
                "store_skipped_blocks", (state.store.cursor - stopped) * self.page_blocks
            )
            return
        now = self.split.clock()
        if state.store.backlog is None or progressed:
            state.store.backlog_since, state.store.backlog_idle = now, 0
        else:
            state.store.backlog_idle += 1
        state.store.backlog = stopped
        self._backlogged[state.request.request_id] = state
        if (
            now - state.store.backlog_since > BACKLOG_TIMEOUT_S
            and state.store.backlog_idle > BACKLOG_TIMEOUT_STEPS
        ):
            self._drop_backlog(state)

    def _drop_backlog(self, state: _ReqState) -> None:
        """Its blocks are gone or it waited too long: those pages are not stored."""
        self.stats.add(
            "store_skipped_blocks", (state.store.cursor - state.store.backlog) * self.page_blocks
        )
        state.store.backlog = None
        self._backlog_done(state)

    def _backlog_done(self, state: _ReqState) -> None:
        self._backlogged.pop(state.request.request_id, None)
        if state.store.free_pending:  # vLLM may free its blocks once its stores land
            state.store.free_pending = False
            self._delayed_free.append(state.request.request_id)
        self._maybe_forget(state)
