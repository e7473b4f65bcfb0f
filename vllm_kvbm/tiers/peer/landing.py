"""Where a peer's reads land: a small pool of the reader's own, and the quarantine.

A landing slot holds a set of slot entries, one entry read again and a
page's header, registered with the reader's NIXL agent once. A page's
payload is READ straight into its host slot (memory the store registered,
``PeerStore.reads_into``) and checked there (store.py); a page for memory
not registered lands whole in the landing slot and is copied out first.

A READ still running at its deadline cannot be called back: measured with
UCX over TCP, a READ from a stopped peer, cancelled (``release_xfer_handle``
OK), its peer's agent removed and the memory deregistered, still landed
about 1 GB in the destination once the peer went on. So the landing slots and the
host slots (``dests``) a READ past its deadline may still write are
quarantined: not used again until that transfer reached a terminal state
(DONE or ERR, polled here; its handle released only then), or its peer is
known gone (NIXL reported it disconnected, or another incarnation answers at
its endpoint). The host slots' addresses are then handed to the store's
caller (``take_ended``), which held them out of use meanwhile (TierIO). A store closed with slots still
quarantined leaves their memory mapped (and registered) for the rest of the
process, never unmapped under a transfer.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import time
from dataclasses import dataclass, field

from vllm_kvbm.tiers.peer.agent import NixlCallError, PeerAgent
from vllm_kvbm.tiers.pool.layout import ALIGN, ENTRY_BYTES

logger = logging.getLogger(__name__)


@dataclass
class _Stuck:
    """A transfer past its deadline and the landing slots it may still write."""

    handle: object
    slots: list[int]
    peer: int  # the peer's generation (store.py)
    dests: list[int] = field(default_factory=list)  # host slots' addresses it may write
    since: float = field(default_factory=time.monotonic)


class LandingSlots:
    def __init__(self, agent: PeerAgent, stored_bytes: int, count: int, ways: int):
        if count < 1:
            raise ValueError("at least one landing slot")
        self._agent = agent
        self.count, self.ways = count, ways
        self.stride = -(-stored_bytes // ALIGN) * ALIGN
        self._entries_off = count * self.stride
        self.entry_span = (ways + 1) * ENTRY_BYTES  # a set, then one entry read again
        size = self._entries_off + -(-count * self.entry_span // ALIGN) * ALIGN
        self._map = mmap.mmap(-1, size)
        self._cbuf = ctypes.c_char.from_buffer(self._map)
        self.addr = ctypes.addressof(self._cbuf)
        self.view = memoryview(self._map)
        self.size = size
        self._reg = agent.register(self.addr, size)
        self._free = list(range(count))
        self._stuck: list[_Stuck] = []
        self._ended: list[int] = []  # dests whose transfer ended, not taken yet

    # -- where things land -------------------------------------------------------
    def page_off(self, slot: int) -> int:
        return slot * self.stride

    def set_off(self, slot: int) -> int:
        return self._entries_off + slot * self.entry_span

    def again_off(self, slot: int) -> int:
        return self.set_off(slot) + self.ways * ENTRY_BYTES

    # -- slots --------------------------------------------------------------------
    def take(self, n: int) -> list[int]:
        """Up to ``n`` free slots (fewer while others are quarantined)."""
        taken, self._free = self._free[:n], self._free[n:]
        return taken

    def give(self, slots: list[int]) -> None:
        self._free.extend(slots)

    @property
    def quarantined(self) -> int:
        return sum(len(s.slots) for s in self._stuck)

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def quarantined_dests(self) -> int:
        """Host slots a transfer past its deadline may still write."""
        return sum(len(s.dests) for s in self._stuck)

    def quarantine(
        self, slots: list[int], handle, peer: int, dests: list[int] | None = None
    ) -> None:
        self._stuck.append(_Stuck(handle, list(slots), peer, list(dests or ())))
        logger.warning(
            "KVBM: peer tier: a READ missed its deadline; %d landing slot(s) "
            "(%d of %d now) and %d host slot(s) quarantined until it ends or its "
            "peer is known gone",
            len(slots),
            self.quarantined,
            self.count,
            len(dests or ()),
        )

    def take_ended(self) -> list[int]:
        """The ``dests`` of quarantined transfers that ended since last asked."""
        ended, self._ended = self._ended, []
        return ended

    def reap(self, gone=lambda peer: False) -> int:
        """Frees the slots of quarantined transfers that ended, or whose peer
        ``gone(peer generation)`` says is gone; the number of slots freed."""
        freed, still = 0, []
        for stuck in self._stuck:
            ended = gone(stuck.peer)
            if not ended:
                try:
                    state = self._agent.call("check_xfer_state", "check_xfer_state", stuck.handle)
                    ended = state != "PROC"
                except NixlCallError as err:
                    ended = err.disconnected
                    if not ended:
                        logger.debug("KVBM: peer tier: quarantined transfer: %s", err)
            if ended:
                self._release(stuck.handle)
                self._free.extend(stuck.slots)
                self._ended.extend(stuck.dests)
                freed += len(stuck.slots)
                logger.info(
                    "KVBM: peer tier: %d landing and %d host slot(s) out of "
                    "quarantine after %.1f s",
                    len(stuck.slots),
                    len(stuck.dests),
                    time.monotonic() - stuck.since,
                )
            else:
                still.append(stuck)
        self._stuck = still
        return freed

    def _release(self, handle) -> None:
        try:
            self._agent.call("release_xfer_handle", "release_xfer_handle", handle)
        except NixlCallError as err:  # NIXL keeps a handle it cannot free (its leak list)
            logger.debug("KVBM: peer tier: release_xfer_handle: %s", err)

    def close(self) -> None:
        """Deregisters and unmaps, unless transfers are still quarantined:
        then the memory stays (see the module docstring)."""
        self.reap()
        if self._stuck:
            logger.warning(
                "KVBM: peer tier: %d landing slot(s) still quarantined at close: "
                "their memory stays mapped until the process exits",
                self.quarantined,
            )
            return
        self._agent.deregister(self._reg)
        self.view.release()
        del self._cbuf
        self._map.close()
