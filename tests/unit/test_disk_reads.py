"""How DiskStore reads pages, on real files: several in flight, each into its
own slot; a page not in the page cache with O_DIRECT, still checked; and
buffered when O_DIRECT is off.
"""

from __future__ import annotations

import os

import pytest
import torch

from helpers.tier_pages import BIG, SMALL, key, page
from test_disk_store import path_of
from test_disk_store import disk  # noqa: F401 (fixture)
from vllm_kvbm.tiers.page_format import HEADER_BYTES


def test_pages_read_in_flight_land_in_their_own_slots(disk):
    """get_many_into (TierIO's fetch) reads on the store's reader threads;
    each result and page belongs to its own slot, and a missing page's slot
    is left alone (a damaged page's slot holds what was read: unused, since
    its status is not "ok")."""
    import threading

    s = disk(block=BIG)
    for i in range(6):
        assert s.put(key(i), page(i, BIG))
    with open(path_of(s, key(2)), "r+b") as f:  # damage
        f.seek(HEADER_BYTES + BIG - 1)
        f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
    os.remove(path_of(s, key(4)))
    slots = torch.full((8, BIG), 0xAB, dtype=torch.uint8)
    got = s.get_many_into([(key(i), slots[i]) for i in range(8)])
    assert got == ["ok", "ok", "corrupt", "ok", "miss", "ok", "miss", "miss"]
    for i in (0, 1, 3, 5):
        assert torch.equal(slots[i], page(i, BIG))
    for i in (4, 6, 7):
        assert bool((slots[i] == 0xAB).all()), f"slot {i} written"
    assert any(t.name.startswith("kvbm-disk-read") for t in threading.enumerate())
    assert not s.contains(key(2)) and not s.contains(key(4))


def _drop_cached(path: str) -> None:
    """Writes the file's pages back and drops them from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.parametrize("block", [BIG, SMALL])
def test_a_page_not_in_the_page_cache_is_read_with_o_direct_and_still_checked(disk, block):
    """A cached page is read buffered; one that is not (cold) with O_DIRECT
    into the reading thread's aligned buffer, checked there and copied into
    the slot; damage on the device is still "corrupt" and the page removed."""
    s = disk(block=block)
    if not s._direct:
        pytest.skip("this filesystem refuses O_DIRECT")
    for i in range(4):
        assert s.put(key(i), page(i, block))
    out = torch.empty(block, dtype=torch.uint8)
    assert s.get_into(key(0), out) == "ok" and torch.equal(out, page(0, block))
    assert s._bounce().reads == 0  # in the page cache: read buffered
    _drop_cached(path_of(s, key(0)))
    out.zero_()
    assert s.get_into(key(0), out) == "ok" and torch.equal(out, page(0, block))
    assert s._bounce().reads == 1
    with open(path_of(s, key(1)), "r+b") as f:  # damaged, then only on the device
        f.seek(HEADER_BYTES + block // 2)
        f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
    _drop_cached(path_of(s, key(1)))
    assert s.get_into(key(1), out) == "corrupt" and s._bounce().reads == 2
    assert not os.path.exists(path_of(s, key(1))) and not s.contains(key(1))
    # Several cold pages in flight, each on its reader's own buffer.
    for i in (2, 3):
        _drop_cached(path_of(s, key(i)))
    slots = torch.zeros(2, block, dtype=torch.uint8)
    assert s.get_many_into([(key(2), slots[0]), (key(3), slots[1])]) == ["ok", "ok"]
    assert torch.equal(slots[0], page(2, block)) and torch.equal(slots[1], page(3, block))


def test_o_direct_off_reads_cold_pages_buffered(disk):
    s = disk(block=BIG, direct_reads=False)
    assert s.put(key(0), page(0, BIG))
    _drop_cached(path_of(s, key(0)))
    out = torch.empty(BIG, dtype=torch.uint8)
    assert s._bounce() is None
    assert s.get_into(key(0), out) == "ok" and torch.equal(out, page(0, BIG))
