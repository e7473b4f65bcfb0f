"""A peer's pages read a layer at a time, for hits loaded during the forward pass.

A peer hit loaded before the step (store.py) reads every page whole, then
the step copies it in as a host hit: its time to first token is the read
plus a host hit. Read layer by layer (worker/layer_reads.py drives it), the
step's READs overlap the layers computed before:

1. ``start``: one READ of each page's set of slot entries, the slot picked,
   one READ of each picked slot's header (into a header landing slot of
   the store's own: 256 of them, a few KiB each), the header checked
   (codec.start_verify);
2. ``read(k)``: one READ of layer k's byte range of every page, straight
   into its host slot (memory the store registered, ``reads_into``), each
   range then checked as it lies (the checksum, or decrypted in place under
   the page secret), exactly as a whole page's bytes are checked in order;
3. ``finish``: one READ of each picked entry again: the slot's generation
   and key must be the same as in (1) (the seqlock), else the page is a
   miss; then each page's verdict.

Until ``finish`` the bytes in a slot are unchecked and what the step
computed from them is thrown away if a page is not "ok" (the step's loads
fail; vLLM recomputes them). Every READ has the step's deadline; one past it
is quarantined with the host slots it may still write (landing.py), which
``close`` returns: the caller keeps those slots out of use until the store
names them ended (``PeerStore.take_ended_layer_reads``).

Each call takes the store's lock (its NIXL agent and peers are shared with
the whole-page reads of asynchronous loads) for at most the time left to the
deadline; the checks run outside it.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from vllm_kvbm.tiers.page_format import HEADER_BYTES, valid_page
from vllm_kvbm.tiers.peer.landing import LandingSlots
from vllm_kvbm.tiers.pool import layout
from vllm_kvbm.tiers.pool.layout import ENTRY_BYTES, MAX_WAYS

if TYPE_CHECKING:
    from vllm_kvbm.tiers.peer.peer_links import _Peer
    from vllm_kvbm.tiers.peer.store import PeerStore

logger = logging.getLogger(__name__)

# Pages one layered read holds header landing slots for (the scheduler sends
# at most this many lower-tier pages a layered load: prefix_lookup.py).
HEADER_SLOTS = 256


class PeerPageLayers:
    """``items``' pages (key, host slot) on ``peer``, read a byte range of
    ``ranges`` (payload offset, bytes) at a time; ``slots``: the header
    landing slots taken for them; ``deadline``: time.monotonic()."""

    def __init__(
        self,
        store: "PeerStore",
        peer: "_Peer",
        items: list[tuple[bytes, torch.Tensor]],
        ranges: list[tuple[int, int]],
        slots: list[int],
        deadline: float,
    ):
        self._store, self._peer, self._ranges = store, peer, ranges
        # the peer as the slots were picked: a hello in between that finds
        # another incarnation or mapping fails the read (checked per READ)
        self._seen = (peer.generation, peer.geometry, peer.base)
        self._keys = [bytes(key) for key, _ in items]
        self._addrs = [out.data_ptr() for _, out in items]
        self._views = [memoryview(out.numpy()) for _, out in items]
        self._slots, self.deadline = slots, deadline
        self.statuses = ["skipped"] * len(items)
        self._tkeys = [layout.table_key(store._codec.names, k) for k in self._keys]
        self._picked: list[tuple[int, int]] = []  # (slot in the pool, generation) per page
        self._checks: list = []
        self._late: list[int] = []  # host slots a READ past its deadline may write
        self._quarantined = False

    def _xfer(self, spans: list[tuple[int, int, int]], dests: list[int] | None = None) -> bool:
        """One READ under the store's lock; False (every page "error") if it
        failed, missed the deadline or the lock did not come in time."""
        store, peer = self._store, self._peer
        with store.locked(self.deadline) as held:
            state = "failed"
            seen = (peer.generation, peer.geometry, peer.base)
            if held and peer.remote is not None and seen == self._seen:
                state = store._xfer(peer, self._slots, self.deadline, spans, dests, store.heads)
        if state == "done":
            return True
        if state == "late":
            self._quarantined = True
            self._late += dests or []
        self.statuses = ["error"] * len(self.statuses)
        return False

    def start(self) -> bool:
        """The entries and headers read and checked: False when a page's
        status decides the step already (``statuses``)."""
        store = self._store
        _, g, base = self._seen
        heads = store.heads
        firsts = [g.set_of(t) * g.ways for t in self._tkeys]
        if not self._xfer(
            [
                (heads.addr + heads.set_off(s), base + g.entry_off(f), g.ways * ENTRY_BYTES)
                for s, f in zip(self._slots, firsts)
            ]
        ):
            return False
        for i, (s, t) in enumerate(zip(self._slots, self._tkeys)):
            hit = layout.find_in_set(heads.view, heads.set_off(s), g.ways, t)
            if hit is None:
                self.statuses[i] = "miss"  # gone since the lookup: the step recomputes
                return False
            self._picked.append((firsts[i] + hit[0], hit[1]))
        if not self._xfer(
            [
                (heads.addr + heads.page_off(s), base + g.slot_off(slot), HEADER_BYTES)
                for s, (slot, _) in zip(self._slots, self._picked)
            ]
        ):
            return False
        for i, (s, key) in enumerate(zip(self._slots, self._keys)):
            off = heads.page_off(s)
            check = store._codec.start_verify(bytes(heads.view[off : off + HEADER_BYTES]), key)
            if isinstance(check, str):
                self.statuses[i] = check
                return False
            self._checks.append(check)
        return True

    def read(self, k: int, stop=None) -> bool:
        """Range ``k`` of every page into its slot, then checked there."""
        off, n = self._ranges[k]
        _, g, base = self._seen
        if not self._xfer(
            [
                (addr + off, base + g.slot_off(slot) + HEADER_BYTES + off, n)
                for addr, (slot, _) in zip(self._addrs, self._picked)
            ],
            self._addrs,
        ):
            return False
        for check, view in zip(self._checks, self._views):
            check.update(view[off : off + n])
        return True

    def finish(self) -> None:
        """Each page's verdict (``statuses``): a slot rewritten since its
        entry was read is a miss (torn), never used."""
        store, heads = self._store, self._store.heads
        _, g, base = self._seen
        if not self._xfer(
            [
                (heads.addr + heads.again_off(s), base + g.entry_off(slot), ENTRY_BYTES)
                for s, (slot, _) in zip(self._slots, self._picked)
            ]
        ):
            return
        for i, (s, (_, gen)) in enumerate(zip(self._slots, self._picked)):
            if layout.read_head(heads.view, heads.again_off(s)) != (gen, self._tkeys[i]):
                self.statuses[i] = "miss"
                with store.locked(None):
                    store.torn_reads += 1
            else:
                self.statuses[i] = self._checks[i].finish(self._views[i])

    def close(self) -> list[int]:
        """The header landing slots given back (unless a READ past its
        deadline may write them: then once it ends); the host slots' addresses
        such a READ may still write."""
        self._store.layers_closed(self._slots, self._quarantined)
        self._views = []
        return self._late


class LayeredReads:
    """``PeerStore``'s part (store.py, which holds the state): layered reads
    opened, closed, and their late READs' host slots."""

    def open_layers(
        self, items: list[tuple[bytes, torch.Tensor]], endpoint: str | None, ranges, deadline
    ) -> "PeerPageLayers | str":
        """``items``' pages (key, host slot) on the peer at ``endpoint``,
        opened for reads a byte range of ``ranges`` at a time, within
        ``deadline`` (time.monotonic()): page_layers.py; or the status of
        every page when they cannot be ("miss": no peer named; "error")."""
        if endpoint is None:
            return "miss"
        with self.locked(deadline) as held:
            if not held or self._closed:
                return "error"
            # open from here until layers_closed: batches wait, a hello out
            # (the lock let go meanwhile) included
            self.layered_open += 1
            slots: list[int] = []
            try:
                peer = self._ready_peer(endpoint, deadline)
                if (
                    peer is None
                    or time.monotonic() >= deadline
                    or not all(
                        valid_page(out, self.page_bytes) and self._in_place(out) for _, out in items
                    )
                ):
                    self.layers_closed(slots, False)
                    return "error"  # e.g. a slot not registered: read before the step
                if self.heads is None:
                    self.heads = LandingSlots(self._agent, HEADER_BYTES, HEADER_SLOTS, MAX_WAYS)
                slots = self.heads.take(len(items))
                if len(slots) < len(items):
                    self.layers_closed(slots, False)
                    return "error"
                return PeerPageLayers(self, peer, items, ranges, slots, deadline)
            except Exception as err:  # noqa: BLE001 - a store must not take the engine down
                logger.warning("KVBM: peer tier: %s: %s", endpoint, err)
                self.layers_closed(slots, False)
                return "error"

    def layers_closed(self, slots: list[int], quarantined: bool) -> None:
        """A layered read's end: its header slots back (if ``quarantined``, once it ends)."""
        with self._lock:
            if not quarantined and slots:
                self.heads.give(slots)
            self.layered_open -= 1
            self._turn.notify_all()

    def take_ended_layer_reads(self) -> list[int]:
        """take_ended_writes for layered reads' host slots (``open_layers``)."""
        with self._lock:
            self.reap()
            return self.heads.take_ended() if self.heads is not None else []

    @contextmanager
    def locked(self, deadline: float | None):
        """The lock, waited for until ``deadline`` (monotonic; None: no bound): held?"""
        timeout = -1 if deadline is None else max(0.0, deadline - time.monotonic())
        held = self._lock.acquire(timeout=timeout)
        try:
            yield held
        finally:
            if held:
                self._lock.release()
