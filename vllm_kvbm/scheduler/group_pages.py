"""A hybrid model's pages: one per (page of tokens, KV cache group).

With vLLM's hybrid allocator each KV cache group has its own blocks from one
shared pool; block ``b`` of any group is the same bytes of the same tensors
(worker/kv_regions.py), so a group's page is ``page_blocks`` blocks like any
page, in a host slot like any page. Each group is paged as a hit at a page
boundary ``b`` reads it (as vLLM's OffloadingConnector does,
``kv_connector/v1/offloading/scheduler.py``):

- full attention: every page of the prefix. The primary group's page (the
  first full-attention group's) carries the prefix's key, so lookups, KV
  events and the tiers' bookkeeping run on it as for a dense model; every
  other group's page is ``group_key(key, group)``: a group's page can never
  be read as another's.
- sliding window: the ``window`` tokens before ``b``. A window page is
  stored only when it lies in the window before a boundary a later hit may
  end at: the prompt's last full page (and the page before its last token,
  where the same prompt's hit ends), and every ``WINDOW_HIT_SPACING``
  windows; bytes stored for a sliding layer are about 1 / WINDOW_HIT_SPACING
  of a full layer's (plus the prompt's last window), not the whole prefix.
- chunked-local attention (Llama 4): the hit's end's chunk, from its start;
  kept like a window, before the prompt's end (a hit at a chunk's start
  reads none of it).
- state (Mamba, Gated DeltaNet in vLLM's align mode): the block holding the
  state at ``b``. vLLM's align-mode block tables are not positional (a
  prefill checkpoint, EAGLE/MTP's speculative blocks and a
  ``prefix_match_unit`` below the block size put a boundary's state in
  another column), so the state stored for ``b`` is the block vLLM hands
  off for exactly ``b`` tokens (``boundary_states``): the boundaries its
  own prefix cache keeps (each prompt's replay boundary, shared-prefix
  junctions, every ``--prefix-cache-retention-interval`` tokens). A vLLM
  without hand-offs is read by position, and the settings that move a state
  keep the model out of KVBM (engine_info.py).

A hit is the longest prefix whose every group has what it reads; what a
lookup found is checked again against the blocks vLLM allocates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_kvbm.engine_info import vllm_hands_off_states
from vllm_kvbm.keys import PageKey, group_key
from vllm_kvbm.messages import SKIP

if TYPE_CHECKING:
    from vllm_kvbm.engine_info import EngineInfo, GroupInfo

# A sliding-window group keeps the window before every this many windows'
# worth of pages (and before the prompt's end): where a hit that is not a
# returning prompt's end can stop.
WINDOW_HIT_SPACING = 4
NULL_BLOCK = 0  # vLLM's null block: a block the group does not hold
# Group kinds whose hit reads the pages from a first one to the hit's end
WINDOWED = ("window", "chunk")


@dataclass(frozen=True)
class Unit:
    """One group's page: its page index, group, key and engine blocks."""

    page: int
    group: int
    key: PageKey
    blocks: tuple[int, ...]


class GroupPages:
    def __init__(self, info: "EngineInfo"):
        self.primary = info.primary
        self.others = tuple(g for g in info.groups if g.index != info.primary)
        self.page_tokens = info.page_tokens
        self.page_blocks = info.page_blocks
        self._spacing = {g.index: self._hit_spacing(g) for g in self.others if g.kind in WINDOWED}
        self._state_groups = frozenset(g.index for g in self.others if g.kind == "state")
        # vLLM names the block of each state boundary (else: by position)
        self.handed_off = vllm_hands_off_states()

    def boundary_states(self, out, block_ids) -> dict[str, dict[tuple[int, int], int]]:
        """The state blocks vLLM hands off in scheduler output ``out``, per
        request: (page, group) -> block, for boundaries at a page's end.
        vLLM records (group, block, boundary tokens) for each state its
        prefix cache keeps, as it schedules the step whose forward computes
        it (``SchedulerOutput.kv_connector_block_state``); a boundary inside
        a page (a partial tail, copied on write) is not stored. A request
        preempted or finished this step gave its blocks up, and a block no
        longer in the request's table may be another's: both skipped (as
        vLLM's own offloading does). ``block_ids(req_id)``: its blocks per
        group, as vLLM's KV cache manager has them now."""
        handoffs = getattr(
            getattr(out, "kv_connector_block_state", None), "boundary_state_offloads", None
        )
        if not handoffs or not self._state_groups:
            return {}
        gone = set(out.preempted_req_ids or ()) | set(out.finished_req_ids or ())
        states: dict[str, dict[tuple[int, int], int]] = {}
        for req_id, entries in handoffs.items():
            if req_id in gone:
                continue
            table = None
            for group, block, boundary in entries:
                if (
                    group not in self._state_groups
                    or block == NULL_BLOCK
                    or boundary <= 0
                    or boundary % self.page_tokens
                ):
                    continue
                table = table if table is not None else block_ids(req_id)
                if block in table[group]:
                    page = boundary // self.page_tokens - 1
                    states.setdefault(req_id, {})[(page, group)] = block
        return states

    def _hit_spacing(self, g: "GroupInfo") -> int:
        """Pages between the boundaries, besides the prompt's end, before which
        a window or chunk group's pages are kept: every chunk for a chunk
        group whose chunks are whole pages (a hit at a chunk's start reads
        none of it), else every WINDOW_HIT_SPACING windows."""
        if g.kind == "chunk" and g.window % self.page_tokens == 0:
            return g.window // self.page_tokens
        return WINDOW_HIT_SPACING * max(1, -(-g.window // self.page_tokens))

    def first_window_page(self, g: "GroupInfo", boundary: int) -> int:
        """The first page a hit ending at page ``boundary`` reads of window or
        chunk group g: the window before it, or the start of its chunk."""
        end = boundary * self.page_tokens
        first = end // g.window * g.window if g.kind == "chunk" else max(0, end - g.window)
        return first // self.page_tokens

    def _window_kept(self, g: "GroupInfo", page: int, prompt_tokens: int) -> bool:
        """Whether page ``page`` of window group g lies in the window before a
        boundary a hit may end at: the prompt's last full page (the next
        turn of a conversation), the page before its last token (the same
        prompt again: vLLM computes at least that token), a multiple of the
        spacing (a prompt sharing a prefix)."""
        for end in {prompt_tokens // self.page_tokens, (prompt_tokens - 1) // self.page_tokens}:
            if page < end and self.first_window_page(g, end) <= page:
                return True
        spacing = self._spacing[g.index]
        boundary = (page // spacing + 1) * spacing  # the first one after the page
        return self.first_window_page(g, boundary) <= page

    def store_units(
        self,
        keys: list[PageKey],
        pages: range,
        group_blocks,
        prompt_tokens: int,
        states: dict[tuple[int, int], int] | None = None,
    ) -> list[Unit]:
        """The group pages to store of ``pages`` (completed this step):
        ``group_blocks[g]`` are group g's engine block ids for the request,
        ``states`` the state blocks vLLM handed off this step by (page,
        group) (``boundary_states``; None: none)."""
        g_blocks, units = self.page_blocks, []
        states = states or {}
        for i in pages:
            span = slice(i * g_blocks, (i + 1) * g_blocks)
            units.append(Unit(i, self.primary, keys[i], tuple(group_blocks[self.primary][span])))
            for g in self.others:
                blocks = tuple(group_blocks[g.index][span])
                if len(blocks) < g_blocks:
                    continue
                if g.kind == "state":
                    state = states.get((i, g.index)) if self.handed_off else blocks[-1]
                    if state is None or state == NULL_BLOCK:
                        continue  # no state kept at this page's end
                    blocks = (SKIP,) * (g_blocks - 1) + (state,)
                elif NULL_BLOCK in blocks or (
                    g.kind in WINDOWED and not self._window_kept(g, i, prompt_tokens)
                ):
                    continue
                units.append(Unit(i, g.index, group_key(keys[i], g.index), blocks))
        return units

    def needed(self, start: int, boundary: int) -> list[tuple[int, int]]:
        """(page, group) of the other groups' pages a hit of pages
        [start, boundary) loads."""
        full = [
            (i, g.index) for g in self.others if g.kind == "full" for i in range(start, boundary)
        ]
        return full + self._tail(start, boundary)

    def _tail(self, start: int, boundary: int) -> list[tuple[int, int]]:
        """The window and state groups' part of ``needed``."""
        out = []
        for g in self.others:
            if g.kind in WINDOWED:
                first = max(start, self.first_window_page(g, boundary))
                out += [(i, g.index) for i in range(first, boundary)]
            elif g.kind == "state":
                out.append((boundary - 1, g.index))
        return out

    def longest_hit(self, start: int, end: int, found) -> int:
        """The largest boundary b in (start, end] whose needed pages are all
        ``found((page, group))``; ``start`` when none is."""
        for g in self.others:
            if g.kind == "full":  # a prefix: the first page missing ends it
                i = start
                while i < end and found((i, g.index)):
                    i += 1
                end = i
        for b in range(end, start, -1):
            if all(found(u) for u in self._tail(start, b)):
                return b
        return start

    def load_units(
        self, keys: list[PageKey], start: int, boundary: int, local_blocks: int, group_blocks
    ) -> list[Unit] | None:
        """The other groups' pages to load of a hit of pages [start, boundary)
        into the blocks vLLM allocated (a null block: not loaded; blocks
        vLLM's own cache had: SKIP). None when vLLM allocated a block this hit
        does not fill (vLLM's allocation and ``needed`` disagree): the load is
        refused and recomputed, never served partly."""
        g_blocks, units = self.page_blocks, []
        # a window page may be partly before what vLLM keeps: never allocated
        want = set(self.needed(start, boundary))
        for g in self.others:
            for i in range(start, boundary):
                span = group_blocks[g.index][i * g_blocks : (i + 1) * g_blocks]
                blocks = tuple(
                    SKIP if b == NULL_BLOCK or i * g_blocks + j < local_blocks else b
                    for j, b in enumerate(span)
                )
                if all(b == SKIP for b in blocks):
                    continue
                if (i, g.index) not in want or (g.kind == "state" and blocks[-1] == SKIP):
                    return None
                units.append(Unit(i, g.index, group_key(keys[i], g.index), blocks))
        return units
