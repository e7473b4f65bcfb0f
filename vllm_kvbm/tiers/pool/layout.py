"""The shared page pool's file layout: a superblock, a slot table and the pages.

One pool file holds one namespace's pages for one TP rank of one world size
(``file_name``), in a directory on a memory filesystem (``/dev/shm``)::

    superblock (4 KiB) | slot table (nslots x 64 B, padded to 4 KiB) | pages (nslots x stride)

Each page is stored encoded, exactly as the disk and Redis store it
(page_format.py: header with key, namespace scope, TP rank and world,
layout, CRC, and the AES-GCM seal under a page secret), in a slot of
``stride`` bytes (the stored page rounded up to 4 KiB).

The slot table is the index, so no process needs to ask another where a page
is: it is set-associative. A key's set is its table key's first 8 bytes
(little endian) modulo ``nsets``, and the set is ``ways`` consecutive
entries; the key is in one of them or not in the pool. A scheduler reads a
set from its read-only mapping (memory reads only), a worker from its own,
and a peer on another machine with one small NIXL READ of the set's entries.

A slot entry (64 bytes): ``generation`` (u64, a seqlock: odd while a write
is in progress), the table key (32 bytes; all zero: empty), ``last_use``
(u64, nanoseconds: the set's LRU order) and 16 spare bytes. A writer (under
the pool's write lock, pool_file.py) makes the generation odd, writes the
page, then the key, then makes the generation even again. A reader accepts a
slot only if the generation was even and the same before and after it read
the page, the key matched both times, and the page then verifies for the key
(its header and checksum or seal): a slot torn or reused under a reader is a
miss, never another page's KV. The seqlock relies on stores becoming visible
in program order (x86); elsewhere a torn read still fails the page's own
check, which is what decides.

This module imports neither torch nor NIXL: the scheduler's view uses it.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from vllm_kvbm.tiers.page_format import name_scope, page_scope

MAGIC = b"KVBMPOOL"
FORMAT = 1
SUPERBLOCK_BYTES = 4096
ENTRY_BYTES = 64
ALIGN = 4096
# Slots per set: a set is read whole (at most 1 KiB: one small READ for a
# peer) and more ways mean fewer pages evicted while the pool still has room
# elsewhere; from 8 to 16, as divides the slots best.
MAX_WAYS = 16
MIN_WAYS = 8
KEY_BYTES = 32
EMPTY_KEY = bytes(KEY_BYTES)

LIVE, RETIRED = 0, 1

# magic, format, state, name digest, scope digest, stored bytes, stride,
# slots, ways, table offset, data offset, file bytes, incarnation, owner pid,
# created (ns since the epoch), used slots
_SUPER = struct.Struct("<8sII16s32sQQQQQQQ16sQQQ")
STATE_OFF = 12
USED_OFF = _SUPER.size - 8
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_HEAD = struct.Struct("<Q32s")  # an entry's generation and key
_ENTRY = struct.Struct("<Q32sQ16x")
LAST_USE_OFF = 40  # within an entry


def _round_up(n: int, unit: int = ALIGN) -> int:
    return -(-n // unit) * unit


@dataclass(frozen=True)
class Geometry:
    """Where everything lies in a pool file of ``nslots`` slots of one page each."""

    stored_bytes: int  # header + payload of one page
    nslots: int
    ways: int

    @property
    def stride(self) -> int:
        return _round_up(self.stored_bytes)

    @property
    def nsets(self) -> int:
        return self.nslots // self.ways

    @property
    def table_off(self) -> int:
        return SUPERBLOCK_BYTES

    @property
    def data_off(self) -> int:
        return self.table_off + _round_up(self.nslots * ENTRY_BYTES)

    @property
    def file_bytes(self) -> int:
        return self.data_off + self.nslots * self.stride

    @classmethod
    def for_capacity(cls, capacity_bytes: int, stored_bytes: int) -> "Geometry | None":
        """The most slots ``capacity_bytes`` holds (the table counted), in whole
        sets of 8 to 16 ways, whichever leaves the fewest out (one set of all
        of them up to 16); None: not one."""
        stride = _round_up(stored_bytes)
        room = capacity_bytes - SUPERBLOCK_BYTES
        n = max(0, room // (stride + ENTRY_BYTES))
        while n and SUPERBLOCK_BYTES + _round_up(n * ENTRY_BYTES) + n * stride > capacity_bytes:
            n -= 1
        if n < 1:
            return None
        if n <= MAX_WAYS:
            return cls(stored_bytes, n, n)  # one set
        # the ways (8 to 16) that leave the fewest slots out of whole sets
        ways = max(range(MIN_WAYS, MAX_WAYS + 1), key=lambda w: (n // w * w, w))
        return cls(stored_bytes, n // ways * ways, ways)

    def set_of(self, tkey: bytes) -> int:
        return int.from_bytes(tkey[:8], "little") % self.nsets

    def entry_off(self, slot: int) -> int:
        return self.table_off + slot * ENTRY_BYTES

    def slot_off(self, slot: int) -> int:
        return self.data_off + slot * self.stride


@dataclass(frozen=True)
class Superblock:
    name_digest: bytes
    scope_digest: bytes
    geometry: Geometry
    incarnation: bytes
    owner_pid: int
    created_ns: int
    state: int = LIVE
    used_slots: int = 0

    def pack(self) -> bytes:
        g = self.geometry
        return _SUPER.pack(
            MAGIC,
            FORMAT,
            self.state,
            self.name_digest,
            self.scope_digest,
            g.stored_bytes,
            g.stride,
            g.nslots,
            g.ways,
            g.table_off,
            g.data_off,
            g.file_bytes,
            self.incarnation,
            self.owner_pid,
            self.created_ns,
            self.used_slots,
        )

    @classmethod
    def unpack(cls, buf, size: int | None = None) -> "Superblock | None":
        """The superblock at the start of ``buf``; None where it is not one of
        this format, or its geometry is not self-consistent (or larger than
        ``size``, the file's length)."""
        if len(buf) < _SUPER.size:
            return None
        (
            magic,
            fmt,
            state,
            name,
            scope,
            stored,
            stride,
            nslots,
            ways,
            table_off,
            data_off,
            file_bytes,
            inc,
            pid,
            created,
            used,
        ) = _SUPER.unpack_from(buf, 0)
        if magic != MAGIC or fmt != FORMAT or not 0 < ways <= MAX_WAYS or nslots < ways:
            return None
        g = Geometry(stored, nslots, ways)
        if (
            nslots % ways
            or stride != g.stride
            or table_off != g.table_off
            or data_off != g.data_off
            or file_bytes != g.file_bytes
            or (size is not None and size < file_bytes)
        ):
            return None
        return cls(name, scope, g, inc, pid, created, state, used)


def read_state(buf) -> int:
    return _U32.unpack_from(buf, STATE_OFF)[0]


def read_used(buf) -> int:
    return _U64.unpack_from(buf, USED_OFF)[0]


def read_head(buf, off: int) -> tuple[int, bytes]:
    """(generation, key) of the entry at ``off``."""
    return _HEAD.unpack_from(buf, off)


def read_entry(buf, off: int) -> tuple[int, bytes, int]:
    """(generation, key, last_use) of the entry at ``off``."""
    return _ENTRY.unpack_from(buf, off)


def write_u64(buf, off: int, value: int) -> None:
    _U64.pack_into(buf, off, value)


def write_u32(buf, off: int, value: int) -> None:
    _U32.pack_into(buf, off, value)


def find_in_set(buf, base: int, ways: int, tkey: bytes) -> tuple[int, int] | None:
    """(way, generation) of ``tkey`` among the ``ways`` entries at ``base`` of
    ``buf`` (a set as one READ lands it, or in a mapped table), written and
    not being written (even generation); None: not there."""
    for way in range(ways):
        gen, key = _HEAD.unpack_from(buf, base + way * ENTRY_BYTES)
        if key == tkey and not gen & 1:
            return way, gen
    return None


def find(buf, g: Geometry, tkey: bytes) -> tuple[int, int] | None:
    """(slot, generation) of ``tkey`` in the table of a mapped pool file."""
    first = g.set_of(tkey) * g.ways
    hit = find_in_set(buf, g.entry_off(first), g.ways, tkey)
    return None if hit is None else (first + hit[0], hit[1])


# ---- names: what every process computes alike ---------------------------------------


def name_digest(namespace: str, page_bytes: int, rank: int, world_size: int) -> bytes:
    """What a pool file's name is derived from: what page names depend on
    (namespace, page size, format version), the rank and the world size. The
    scheduler, which knows no KV layout, computes it too. Never the secret."""
    return hashlib.sha256(
        b"kvbm-pool-name|"
        + name_scope(namespace, page_bytes)
        + struct.pack("<QQ", rank, world_size)
    ).digest()[:16]


def scope_digest(namespace: str, page_bytes: int, rank: int, world_size: int, layout: str) -> bytes:
    """What a pool file's pages verify against (page_format.page_scope: the
    name's parts and the worker's KV layout): the check a writer and a peer
    make before using a file."""
    return hashlib.sha256(
        b"kvbm-pool-scope|" + page_scope(namespace, page_bytes, rank, world_size, layout)
    ).digest()


def file_name(digest: bytes, rank: int, world_size: int) -> str:
    """``kvbm-pool-<16 hex>-r<rank>of<world>`` from name_digest's bytes."""
    return f"kvbm-pool-{digest[:8].hex()}-r{rank}of{world_size}"


def valid_file_name(name: str) -> bool:
    """Whether ``name`` is one file_name gives (the pool process creates no other)."""
    import re

    return re.fullmatch(r"kvbm-pool-[0-9a-f]{16}-r[0-9]{1,4}of[0-9]{1,4}", name) is not None


def table_key(names, key: bytes) -> bytes:
    """What the table holds for ``key``: the key itself without a page
    secret, a keyed hash of it with one (page_names.PageNames), so a process
    that can read the pool but has no secret learns no page's key."""
    return names.chunk_hash(key).to_bytes(KEY_BYTES, "big")
