"""Scheduler-side index of a fixed-size slot tier (the host tier).

The scheduler owns the bookkeeping and the worker owns the memory, so both
agree on slot numbers without talking: the scheduler picks a slot, the worker
copies into it. A slot moves through

    free -> storing -> ready -> (evicted) -> free

Only ready slots are visible to lookups, so a half-written page is never
loaded. A ready slot with pins (loads in flight) is never evicted, and a
storing slot is never evicted, so no transfer ever touches a slot that has
been handed to another key. A slot that an overdue transfer may still write
is *held*: whatever its key's fate, it is not free again until released.

Every operation a step performs is O(1) per key: ``available`` reads a running
count of evictable (ready, unpinned) entries instead of scanning them.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

from vllm_kvbm.keys import PageKey


@dataclass(slots=True)
class _Entry:
    slot: int
    ready: bool = False
    pins: int = 0
    # cleared while being read: dropped when the last reader unpins it
    doomed: bool = False


class SlotIndex:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._entries: OrderedDict[PageKey, _Entry] = OrderedDict()  # LRU first
        self._free = list(range(num_slots - 1, -1, -1))
        # slot -> overdue transfers (one per worker) that may still write it
        self._held: Counter = Counter()
        self.evictions = 0
        # entries that are ready and unpinned: what an allocation may evict
        self._evictable = 0
        # told of keys that became ready, and of each key whose entry went
        # (evicted or dropped): the KV events (kv_events.py); None: off
        self.on_ready = None
        self.on_removed = None

    def __contains__(self, key: PageKey) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def used_slots(self) -> int:
        return self.num_slots - len(self._free)

    def available(self) -> int:
        """Slots a store or promotion could get now: free or evictable."""
        return len(self._free) + self._evictable

    def is_ready(self, key: PageKey) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.ready

    def ready_run(self, keys: list[PageKey], start: int, end: int) -> int:
        """How many of ``keys[start:end]``, from ``start`` on, are ready in a row."""
        get = self._entries.get
        i = start
        while i < end:
            entry = get(keys[i])
            if entry is None or not entry.ready:
                break
            i += 1
        return i - start

    def pin(self, keys: list[PageKey]) -> list[int]:
        """Protects ready slots from eviction while they are read; returns them."""
        slots = []
        for key in keys:
            entry = self._entries[key]
            assert entry.ready, "only ready slots can be loaded"
            if not entry.pins:
                self._evictable -= 1
            entry.pins += 1
            self._entries.move_to_end(key)
            slots.append(entry.slot)
        return slots

    def unpin(self, keys: list[PageKey]) -> None:
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None and entry.pins > 0:
                entry.pins -= 1
                if entry.pins == 0:
                    if entry.doomed:
                        self.drop(key)
                    elif entry.ready:
                        self._evictable += 1

    def allocate(self, key: PageKey) -> int | None:
        """Reserves a slot for a store of ``key``; None if every slot is busy."""
        assert key not in self._entries
        _, slots, _ = self.allocate_missing([key], 0, 1)
        return slots[0] if slots else None

    def allocate_missing(
        self, keys: list[PageKey], start: int, end: int
    ) -> tuple[list[int], list[int], int]:
        """Reserves slots, in order, for the keys of ``keys[start:end]`` the
        index lacks, until every slot is busy. Returns the positions given a
        slot, their slots, and the position it stopped at (``end`` when no
        slot ran short). One call per store: a prompt chunk is hundreds of
        blocks."""
        entries, free = self._entries, self._free
        positions, slots = [], []
        for i in range(start, end):
            key = keys[i]
            if key in entries:
                continue
            while not free:
                # An evicted entry whose slot is held frees nothing: evict on.
                if not self._evict_one():
                    return positions, slots, i
            slot = free.pop()
            entries[key] = _Entry(slot)
            positions.append(i)
            slots.append(slot)
        return positions, slots, end

    def commit(self, keys: list[PageKey]) -> None:
        """The stores of ``keys`` finished: their slots may now be loaded."""
        get = self._entries.get
        ready = []
        for key in keys:
            entry = get(key)
            if entry is not None and not entry.ready:
                entry.ready = True
                ready.append(key)
                if not entry.pins:
                    self._evictable += 1
        if self.on_ready is not None and ready:
            self.on_ready(ready)

    def drop(self, key: PageKey) -> bool:
        """Forgets ``key`` (failed store, bad data). Pinned entries are kept."""
        entry = self._entries.get(key)
        if entry is None or entry.pins:
            return False
        del self._entries[key]
        if entry.ready:
            self._evictable -= 1
        self._give_back(entry.slot)
        if self.on_removed is not None:
            self.on_removed(key)
        return True

    def hold(self, slots) -> None:
        """Keeps ``slots`` out of use while an overdue transfer may write them."""
        for slot in slots:
            self._held[slot] += 1
            if slot in self._free:  # rare (a transfer past its timeout): O(n) is fine
                self._free.remove(slot)

    def release(self, slots) -> None:
        """The overdue transfer on ``slots`` ended: they may be reused."""
        for slot in slots:
            if slot not in self._held:
                continue
            if self._held[slot] > 1:
                self._held[slot] -= 1
                continue
            del self._held[slot]
            if not any(e.slot == slot for e in self._entries.values()):
                self._free.append(slot)

    def _give_back(self, slot: int) -> None:
        if slot not in self._held:
            self._free.append(slot)

    def clear(self) -> int:
        """Drops every ready entry; returns how many. Entries being read are
        hidden now and dropped when their last reader unpins them, so no
        pre-clear page is served afterwards."""
        ready = [(k, e) for k, e in self._entries.items() if e.ready]
        for key, entry in ready:
            if entry.pins:
                entry.ready, entry.doomed = False, True  # pinned: never counted
            else:
                self.drop(key)
        return len(ready)

    def _evict_one(self) -> bool:
        if not self._evictable:
            return False  # every entry is pinned or being written: no scan
        for key, entry in self._entries.items():
            if entry.ready and not entry.pins:
                del self._entries[key]
                self._evictable -= 1
                self._give_back(entry.slot)
                self.evictions += 1
                if self.on_removed is not None:
                    self.on_removed(key)
                return True
        raise AssertionError("evictable count out of step with the entries")
