"""SlotIndex: the scheduler's bookkeeping of host-tier slots."""

from __future__ import annotations

import pytest

from vllm_kvbm.scheduler.slot_index import SlotIndex


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")


def stored(index: SlotIndex, *ids: int) -> dict[int, int]:
    """Allocates and commits keys; returns id -> slot."""
    slots = {}
    for i in ids:
        slot = index.allocate(k(i))
        assert slot is not None
        index.commit([k(i)])
        slots[i] = slot
    return slots


def test_allocate_gives_distinct_slots_in_range():
    idx = SlotIndex(5)
    slots = [idx.allocate(k(i)) for i in range(5)]
    assert sorted(slots) == list(range(5))
    assert idx.used_slots == 5 and len(idx) == 5


def test_allocate_missing_skips_known_keys_and_stops_when_every_slot_is_busy():
    idx = SlotIndex(3)
    stored(idx, 1)
    idx.allocate(k(9))  # storing: never evicted
    keys = [k(i) for i in range(5)]
    # k(1) is known; k(0) gets the last free slot, k(2) evicts k(1), k(3) finds none
    positions, slots, stopped = idx.allocate_missing(keys, 0, 5)
    assert positions == [0, 2] and stopped == 3
    assert [idx._entries[keys[i]].slot for i in positions] == slots
    assert k(1) not in idx and idx.evictions == 1
    assert idx.allocate_missing(keys, 2, 3) == ([], [], 3)  # known: nothing to do


def test_allocate_missing_evicts_the_least_recent_for_all_missing_keys_at_once():
    # Evicted in one walk of the LRU for every missing key: pinned entries
    # are skipped, and a held slot's entry is evicted without freeing its
    # slot, so one more is evicted in its place; no more than needed.
    idx = SlotIndex(6)
    slots = stored(idx, 0, 1, 2, 3, 4, 5)
    idx.pin([k(0)])
    idx.hold([slots[1]])
    positions, got, stopped = idx.allocate_missing([k(10), k(11), k(12)], 0, 3)
    assert positions == [0, 1, 2] and stopped == 3
    assert sorted(got) == sorted([slots[2], slots[3], slots[4]])
    assert idx.evictions == 4
    assert [i for i in range(6) if k(i) in idx] == [0, 5]
    assert idx.available() == 1  # k(5); k(0) is pinned, the new ones are storing


def test_storing_slots_are_invisible_and_never_evicted():
    idx = SlotIndex(2)
    s0 = idx.allocate(k(0))
    s1 = idx.allocate(k(1))
    assert k(0) in idx and not idx.is_ready(k(0))
    assert count_ready(idx, [k(0)]) == 0
    assert idx.allocate(k(2)) is None  # both storing: nothing to evict
    assert k(0) in idx and k(1) in idx and idx.evictions == 0
    assert idx.clear() == 0  # clear keeps storing entries
    assert len(idx) == 2
    idx.commit([k(1)])
    assert idx.is_ready(k(1)) and not idx.is_ready(k(0))
    s2 = idx.allocate(k(2))  # evicts the only ready entry, k(1)
    assert s2 == s1 and k(1) not in idx and idx.evictions == 1
    assert s0 != s2 and k(0) in idx


def test_lru_order_eviction():
    idx = SlotIndex(3)
    slots = stored(idx, 0, 1, 2)
    assert idx.allocate(k(3)) == slots[0]  # oldest goes first
    idx.commit([k(3)])
    assert k(0) not in idx
    assert idx.allocate(k(4)) == slots[1]
    assert [i for i in range(5) if k(i) in idx] == [2, 3, 4]
    assert idx.evictions == 2


def test_pin_touches_lru_and_protects():
    idx = SlotIndex(3)
    slots = stored(idx, 0, 1, 2)
    assert idx.pin([k(0)]) == [slots[0]]  # in use and now most recently used
    idx.unpin([k(0)])
    # k(0) was touched: k(1) is now the LRU
    assert idx.allocate(k(3)) == slots[1]
    idx.commit([k(3)])
    idx.pin([k(2), k(0)])
    idx.pin([k(2)])  # pinned twice
    # only k(3) is evictable
    assert idx.allocate(k(4)) == slots[1]
    assert idx.allocate(k(5)) is None  # k(4) storing, k(0)/k(2) pinned
    idx.unpin([k(2)])
    assert idx.allocate(k(5)) is None  # still pinned once
    idx.unpin([k(0)])
    assert idx.allocate(k(5)) == slots[0]
    assert idx.is_ready(k(2)) and k(0) not in idx


def test_pin_requires_ready():
    idx = SlotIndex(2)
    idx.allocate(k(0))
    with pytest.raises(AssertionError):
        idx.pin([k(0)])


def count_ready(idx: SlotIndex, keys) -> int:
    """Length of the leading run of ``keys`` that can be loaded now."""
    return idx.ready_run(keys, 0, len(keys))


def test_count_ready_leading_run():
    idx = SlotIndex(4)
    stored(idx, 0, 1, 3)
    idx.allocate(k(2))  # storing
    assert count_ready(idx, [k(0), k(1), k(2), k(3)]) == 2
    assert count_ready(idx, [k(9), k(0)]) == 0
    assert count_ready(idx, []) == 0
    keys = [k(i) for i in range(4)]
    assert idx.ready_run(keys, 3, 4) == 1 and idx.ready_run(keys, 1, 1) == 0
    assert idx.ready_run(keys, 0, 1) == 1  # stops at ``end``


def test_drop():
    idx = SlotIndex(2)
    slots = stored(idx, 0)
    s1 = idx.allocate(k(1))  # storing, e.g. the store failed
    assert idx.drop(k(1)) is True
    assert k(1) not in idx and idx.used_slots == 1
    idx.pin([k(0)])
    assert idx.drop(k(0)) is False and idx.is_ready(k(0))  # pinned: kept
    idx.unpin([k(0)])
    assert idx.drop(k(0)) is True and len(idx) == 0 and idx.used_slots == 0
    assert idx.drop(k(0)) is False  # unknown key
    assert idx.evictions == 0  # drops are not evictions
    assert sorted([idx.allocate(k(5)), idx.allocate(k(6))]) == sorted([slots[0], s1])


def test_clear_frees_idle_ready_and_hides_pinned():
    idx = SlotIndex(4)
    stored(idx, 0, 1, 2)
    idx.allocate(k(3))  # storing
    idx.pin([k(1)])
    assert idx.clear() == 3
    # k(1) keeps its slot until its reader is done, but is never served again
    assert [i for i in range(4) if k(i) in idx] == [1, 3]
    assert not idx.is_ready(k(1))
    assert idx.used_slots == 2
    # the freed slots are reusable, and the survivors keep theirs
    assert idx.allocate(k(7)) is not None and idx.allocate(k(8)) is not None
    assert idx.allocate(k(9)) is None


def test_commit_unknown_and_unpin_unknown_are_noops():
    idx = SlotIndex(1)
    idx.commit([k(0)])
    idx.unpin([k(0)])
    assert len(idx) == 0 and idx.allocate(k(0)) == 0


def test_allocate_existing_key_asserts():
    idx = SlotIndex(2)
    idx.allocate(k(0))
    with pytest.raises(AssertionError):
        idx.allocate(k(0))


def test_clear_hides_pages_being_read_and_drops_them_after():
    idx = SlotIndex(2)
    idx.allocate(b"a")
    idx.commit([b"a"])
    idx.pin([b"a"])  # a load is reading it
    assert idx.clear() == 1
    assert not idx.is_ready(b"a")  # never served again after the reset
    assert b"a" in idx  # but its slot is not reused while the read runs
    idx.unpin([b"a"])
    assert b"a" not in idx and idx.used_slots == 0


def test_held_slots_are_never_reused_until_released():
    # An overdue store on slot s: its key is dropped (the store failed), but a
    # late NIXL write may still land in s, so no other key may get s.
    idx = SlotIndex(3)
    s = idx.allocate(k(0))
    others = stored(idx, 1, 2)
    idx.hold([s, s])  # two workers' overdue stores on the same slot
    assert idx.drop(k(0))
    assert len(idx._held) == 1 and idx.used_slots == 3
    assert idx.available() == 2  # the two ready, evictable entries only
    for i in range(3, 8):  # churn: every allocation evicts, never gets s
        assert idx.allocate(k(i)) in others.values()
        idx.commit([k(i)])
    idx.release([s])
    assert idx.allocate(k(9)) != s  # one writer still holds it
    idx.commit([k(9)])
    idx.release([s])
    assert len(idx._held) == 0
    assert idx.allocate(k(10)) == s  # free again, taken before any eviction
    idx.release([s])  # a stray release frees nothing twice
    assert idx.used_slots == 3 and idx.allocate(k(11)) in others.values()


def test_held_slot_of_a_live_entry_frees_when_both_let_go():
    idx = SlotIndex(2)
    s = idx.allocate(k(0))  # still storing on another worker
    idx.hold([s])
    idx.release([s])
    assert k(0) in idx and idx.used_slots == 1  # the entry still owns it
    idx.hold([s])
    idx.commit([k(0)])
    assert idx.clear() == 1  # dropped, but held: not free yet
    assert idx.used_slots == 1
    idx.release([s])
    assert idx.used_slots == 0
