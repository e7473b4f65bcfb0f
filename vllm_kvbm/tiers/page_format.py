"""The page format every lower tier stores: the header's fields and layout.

A page is stored as ``HEADER (96 B) + payload``. The header holds a magic, a
format version, the checksum algorithm, flags, the seal algorithm, the
payload length, an 8-byte hash of what the page belongs to, the 32-byte key
(zeros on a sealed page), a 32-byte seal field and, last, a CRC over the
header before the seal field, the stored payload and the seal field (in that
order, so a writer and a reader compute it in one pass as the bytes go by).
``PageCodec.decode_into`` (page_codec.py) checks all of them, so a flipped
byte, a truncated page, or a page filed under another key, namespace or TP
rank is "corrupt", never "ok".

What a page belongs to (format version 3): the header's 8-byte field hashes
the namespace, the page's size, the TP rank and world size, and the worker's
KV cache layout (``layout``: a fingerprint of the registered KV tensors, see
worker/tier_io.py). A rank's page moved to another rank's name, or read by an
engine whose KV cache is laid out otherwise, is "corrupt". A page's NAME
depends on the namespace, the page size, the rank and world size only, so
the scheduler process (which has no KV cache) names pages too
(page_names.py).

Beside the format: the checksums (page_checksum.py), the seal under a page
secret (page_seal.py), and the byte-buffer helpers the tiers share (below).
This module does not import LMCache: the scheduler process uses it too.
"""

from __future__ import annotations

import ctypes
import hashlib
import struct

import torch

MAGIC = b"KVBT"
# 3: sealed payloads (AES-256-GCM), keyed names, the rank and the KV layout
# in the header check. A page of another version is "corrupt" (and under
# another name: the version is part of the namespace hash).
VERSION = 3
FLAG_TOMBSTONE = 1
FLAG_SEALED = 2  # payload encrypted and authenticated with the deployment secret
FLAG_MAC = FLAG_SEALED
FLAGS = FLAG_TOMBSTONE | FLAG_SEALED
MAC_NONE = 0
MAC_BLAKE3 = 1  # version 2 only (keyed BLAKE3): never read
MAC_GMAC = 2  # version 2 only (AES-256-GMAC): never read
MAC_AES_GCM = 3  # AES-256-GCM: 12-byte nonce, 16-byte tag, 4 zero bytes
GCM_NONCE, GCM_TAG = 12, 16
MAC_BYTES = 32
NO_MAC = bytes(MAC_BYTES)
KEY_BYTES = 32
NO_KEY = bytes(KEY_BYTES)
# magic, version, crc algorithm, flags, seal algorithm, payload length,
# namespace hash, key, seal (nonce + tag), crc
HDR = struct.Struct("<4sHHHHQ8s32s32sI")
HEADER_BYTES = HDR.size  # 96
CRC_OFF = HEADER_BYTES - 4
MAC_OFF = CRC_OFF - MAC_BYTES  # the authenticated header fields end here
# Disk space one page takes: the file is header + payload, and LMCache's
# allocator and disk accounting charge it in whole 4 KiB pages.
_DISK_UNIT = 4096


def disk_page_bytes(page_bytes: int) -> int:
    """Bytes of disk capacity one block's page is charged (the one formula)."""
    return -(-(HEADER_BYTES + page_bytes) // _DISK_UNIT) * _DISK_UNIT


def namespace_hash(namespace: str, page_bytes: int, version: int = VERSION) -> bytes:
    return hashlib.sha256(f"kvbm-tier|v{version}|{page_bytes}|{namespace}".encode()).digest()[:8]


def retired_model_names(namespace: str, page_bytes: int) -> list[str]:
    """The LMCache model names this namespace's pages had in older page format
    versions (the disk tier deletes such files: no engine of this version reads them)."""
    return ["kvbm_" + namespace_hash(namespace, page_bytes, v).hex() for v in range(1, VERSION)]


def length_prefixed(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def name_scope(namespace: str, page_bytes: int) -> bytes:
    """What names depend on: length-prefixed, so no two pairs feed the same bytes."""
    return length_prefixed(namespace.encode()) + struct.pack("<QQ", page_bytes, VERSION)


def page_scope(namespace: str, page_bytes: int, rank: int, world_size: int, layout: str) -> bytes:
    """What a page's header check and seal cover besides its own fields."""
    return (
        name_scope(namespace, page_bytes)
        + struct.pack("<QQ", rank, world_size)
        + length_prefixed(layout.encode())
    )


# ---- byte buffers the tiers share ------------------------------------------------


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[:] = src for 1-D uint8 CPU tensors of equal length.

    A plain single-threaded memmove (GIL released): torch's copy_ fans out
    to its intra-op threads and was 30-100x slower for 2 MiB on a small VM.
    """
    if dst.is_contiguous() and src.is_contiguous():
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), dst.numel())
    else:
        dst.copy_(src)


def flat_u8(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def valid_key(key) -> bool:
    return isinstance(key, (bytes, bytearray)) and len(key) == KEY_BYTES


def valid_page(t, page_bytes: int) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and t.dtype == torch.uint8
        and t.dim() == 1
        and t.device.type == "cpu"
        and t.numel() == page_bytes
    )
