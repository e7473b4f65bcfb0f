"""The checksum in every page's header, computed incrementally.

CRC-32 (zlib's polynomial) through ISA-L's AVX-512/PCLMUL kernel (the
``isal`` package), about 45 GB/s on a 2 MiB page here, GIL released: a page
read from the page cache costs about a tenth more, where google-crc32c's
CRC-32C (about 7.5 GB/s: one crc32 instruction chain) cost two thirds more
and zlib.crc32 (about 4.5 GB/s) more than the read. Without isal, CRC-32C is
written through google-crc32c's libcrc32c (an LMCache dependency), else
zlib.crc32. The header names the algorithm, so a reader verifies either:
CRC-32 pages with isal or zlib, CRC-32C pages with libcrc32c.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import zlib

import numpy as np
import torch

ALG_CRC32 = 1  # zlib.crc32 (computed with ISA-L where installed)
ALG_CRC32C = 2  # Castagnoli, hardware accelerated


def _load_crc32c():
    """crc32c_extend(crc, ptr, n) from the libcrc32c bundled with google-crc32c."""
    candidates = []
    try:
        import google_crc32c

        base = os.path.dirname(google_crc32c.__file__)
        libs = os.path.join(base, "..", "google_crc32c.libs")
        candidates += sorted(glob.glob(os.path.join(libs, "libcrc32c*.so*")))
        candidates += sorted(glob.glob(os.path.join(base, "libcrc32c*.so*")))
    except Exception:  # noqa: BLE001 - optional accelerator
        pass
    found = ctypes.util.find_library("crc32c")
    if found:
        candidates.append(found)
    for path in candidates:
        try:
            fn = ctypes.CDLL(path).crc32c_extend
            fn.restype = ctypes.c_uint32
            fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
            if fn(0, b"123456789", 9) == 0xE3069283:  # the standard check value
                return fn
        except Exception:  # noqa: BLE001
            continue
    return None


def _load_crc32():
    """crc32(data, value) -> (the fast kernel, whether it is ISA-L's)."""
    try:
        from isal import isal_zlib

        if isal_zlib.crc32(b"123456789") == 0xCBF43926:  # the standard check value
            return isal_zlib.crc32, True
    except Exception:  # noqa: BLE001 - optional accelerator
        pass
    return zlib.crc32, False


crc32c_extend = _load_crc32c()
crc32, FAST_CRC32 = _load_crc32()
WRITE_ALG = ALG_CRC32 if FAST_CRC32 or crc32c_extend is None else ALG_CRC32C


def checksum_name() -> str:
    """The checksum pages are written with here, and by what (for reports)."""
    if WRITE_ALG == ALG_CRC32C:
        return "CRC-32C (libcrc32c)"
    return "CRC-32 (ISA-L)" if FAST_CRC32 else "CRC-32 (zlib)"


def checksum(alg: int, prefix: bytes, payload: "torch.Tensor | memoryview") -> int | None:
    """CRC over the header prefix, then the payload (1-D contiguous uint8 CPU
    tensor, or a byte memoryview); None for an algorithm not available here."""
    if alg not in (ALG_CRC32, ALG_CRC32C) or (alg == ALG_CRC32C and crc32c_extend is None):
        return None
    crc = Crc(alg, prefix)
    if isinstance(payload, torch.Tensor):
        payload = memoryview(payload.numpy()) if payload.numel() else b""
    crc.update(payload)
    return crc.value


class Crc:
    """An incremental page checksum (the algorithm named in the header)."""

    def __init__(self, alg: int, prefix: bytes):
        self._alg = alg
        self.value = crc32c_extend(0, prefix, len(prefix)) if alg == ALG_CRC32C else crc32(prefix)

    def update(self, chunk: memoryview) -> None:
        if not len(chunk):
            return
        if self._alg == ALG_CRC32C:
            addr = np.frombuffer(chunk, dtype=np.uint8).ctypes.data
            self.value = crc32c_extend(self.value, addr, len(chunk))
        else:
            self.value = crc32(chunk, self.value)
