"""One batch of a peer read (``PeerStore``'s part, store.py, which holds the state).

Three NIXL READs per batch: the pages' sets of slot entries, the pages (each
header into a landing slot, each payload straight into its ``out`` where that
lies in registered memory, else the whole page into the landing slot), the
picked entries again (the seqlock); then each page checked where it lies,
on a helper thread while the next batch is read. A READ past the deadline is
quarantined with every slot it may still write (landing.py).
"""

from __future__ import annotations

import ctypes
import logging
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from vllm_kvbm.tiers.page_format import HEADER_BYTES, valid_key, valid_page
from vllm_kvbm.tiers.peer.agent import NixlCallError
from vllm_kvbm.tiers.pool import layout
from vllm_kvbm.tiers.pool.layout import ENTRY_BYTES

if TYPE_CHECKING:
    from vllm_kvbm.tiers.peer.peer_links import _Peer

logger = logging.getLogger(__name__)


class BatchReads:
    def _read_batch(
        self, peer: "_Peer", items: list[tuple[bytes, torch.Tensor]], ahead: bool = False
    ) -> list:
        slots = self.landing.take(len(items))
        statuses = ["error"] * len(items)  # past the landing slots free: recomputed
        if not slots:
            return statuses
        deadline = time.monotonic() + self.read_timeout_s
        try:
            self._read_into(peer, items[: len(slots)], slots, statuses, deadline, ahead)
        finally:
            if slots and not self._quarantined(slots):
                self.landing.give(slots)
        return statuses

    def _read_into(
        self,
        peer: "_Peer",
        items,
        slots: list[int],
        statuses: list,
        deadline: float,
        ahead: bool = False,
    ) -> None:
        """``ahead``: another batch follows: the pages are checked on the
        helper thread meanwhile (their statuses Futures)."""
        g, land, base = peer.geometry, self.landing, peer.base
        tkeys = [layout.table_key(self._codec.names, bytes(key)) for key, _ in items]
        set_bytes = g.ways * ENTRY_BYTES
        firsts = [g.set_of(t) * g.ways for t in tkeys]
        if (
            self._xfer(
                peer,
                slots,
                deadline,
                [
                    (land.addr + land.set_off(s), base + g.entry_off(f), set_bytes)
                    for s, f in zip(slots, firsts)
                ],
            )
            != "done"
        ):
            return
        picked: list[tuple[int, int, int]] = []  # (item, slot in the pool, generation)
        for i, (s, t) in enumerate(zip(slots, tkeys)):
            key, out = items[i]
            if not (valid_key(key) and valid_page(out, self.page_bytes) and out.is_contiguous()):
                continue  # "error"
            hit = layout.find_in_set(land.view, land.set_off(s), g.ways, t)
            if hit is None:
                statuses[i] = "miss"
            else:
                picked.append((i, firsts[i] + hit[0], hit[1]))
        if not picked:
            return
        spans, dests = [], []
        for i, slot, _ in picked:
            at, out = land.addr + land.page_off(slots[i]), items[i][1]
            if self._in_place(out):  # the header lands, the payload goes to its slot
                spans += [
                    (at, base + g.slot_off(slot), HEADER_BYTES),
                    (out.data_ptr(), base + g.slot_off(slot) + HEADER_BYTES, self.page_bytes),
                ]
                dests.append(i)
            else:
                spans.append((at, base + g.slot_off(slot), g.stored_bytes))
        state = self._xfer(peer, slots, deadline, spans, [items[i][1].data_ptr() for i in dests])
        if state == "late":
            for i in dests:
                statuses[i] = "late"  # its slot may still be written: held by the caller
        if (
            state != "done"
            or self._xfer(
                peer,
                slots,
                deadline,
                [
                    (land.addr + land.again_off(slots[i]), base + g.entry_off(slot), ENTRY_BYTES)
                    for i, slot, _ in picked
                ],
            )
            != "done"
        ):
            return
        in_place = set(dests)
        for i, _, gen in picked:
            s = slots[i]
            if layout.read_head(land.view, land.again_off(s)) != (gen, tkeys[i]):
                statuses[i] = "miss"  # written while read: torn, never used
                self.torn_reads += 1
                continue
            key, out = items[i]
            off = land.page_off(s)
            hdr = bytes(land.view[off : off + HEADER_BYTES])
            if i not in in_place:
                # copied, then checked where it lies: a late write into the
                # landing slot cannot change what was checked
                ctypes.memmove(out.data_ptr(), land.addr + off + HEADER_BYTES, self.page_bytes)
            if ahead:
                self._checks.append(
                    check := self._checker.submit(self._codec.verify, hdr, bytes(key), out)
                )
                statuses[i] = check
            else:
                statuses[i] = self._codec.verify(hdr, bytes(key), out)

    def _xfer(
        self,
        peer: "_Peer",
        slots: list[int],
        deadline: float,
        spans: list[tuple[int, int, int]],
        dests: list[int] | None = None,
        land=None,
    ) -> str:
        """One READ of (local address, remote address, length) spans, polled
        until done or ``deadline``: "done"; "failed" (the peer then down;
        an error NIXL reports ends the transfer); "late": past the deadline,
        the peer down and the transfer quarantined with the landing
        ``slots`` (of ``land``: the batch landing slots unless named) and
        the host slots at ``dests`` it may still write."""
        batch = land is None
        land = self.landing if batch else land
        handle = None
        try:
            local = self._agent.descs([(addr, n) for addr, _, n in spans])
            remote = self._agent.descs([(addr, n) for _, addr, n in spans])
            handle = self._agent.call(
                "initialize_xfer", "initialize_xfer", "READ", local, remote, peer.remote
            )
            state = self._agent.call("transfer", "transfer", handle)
            pause = 0.0
            while state == "PROC":
                if time.monotonic() > deadline:
                    land.quarantine(slots, handle, peer.generation, dests)
                    if batch:
                        self._quarantine_marks.update(slots)
                    handle = None  # released when it ends (landing.reap)
                    self._down(
                        peer,
                        f"no answer to a READ within {self.read_timeout_s:g} s "
                        f"(peer_read_timeout_s)",
                    )
                    return "late"
                time.sleep(pause)
                pause = min(0.0005, pause + 0.0001)
                state = self._agent.call("check_xfer_state", "check_xfer_state", handle)
            if state != "DONE":
                self._down(peer, f"a READ ended {state}")
                return "failed"
            return "done"
        except NixlCallError as err:
            self._down(peer, str(err), dead=err.disconnected)
            return "failed"
        finally:
            if handle is not None:
                try:
                    self._agent.call("release_xfer_handle", "release_xfer_handle", handle)
                except NixlCallError as err:
                    logger.debug("KVBM: peer tier: %s", err)

    def _quarantined(self, slots: list[int]) -> bool:
        hit = bool(self._quarantine_marks & set(slots))
        self._quarantine_marks -= set(slots)
        return hit


def outcome(check: Future) -> str:
    try:
        return check.result()
    except Exception as err:  # noqa: BLE001 - a store must not take the engine down
        logger.warning("KVBM: peer tier: checking a page failed: %s", err)
        return "error"
