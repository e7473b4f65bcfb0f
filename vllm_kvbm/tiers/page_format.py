"""The page format every lower tier stores, and where the disk tier files a page.

A KV block is stored as one page, ``HEADER (96 B) + payload``. The header
holds a magic, a format version, the checksum algorithm, flags, the MAC
algorithm, the payload length, a hash of the namespace, the full 32-byte key
and a 32-byte MAC; its last field is a CRC over the rest of the header and the
payload. ``decode_into`` checks all of them, so a flipped byte, a truncated
page, or a page filed under another key or namespace is "corrupt", never "ok".

Page MAC (format version 2): with a deployment secret (``page_secret_file`` /
``KVBM_PAGE_SECRET``) every page carries a MAC over the full namespace, the
block size, the header fields (key included) and the payload. A CRC proves
no origin: anyone who can write the disk directory or reach the remote
server can plant a page for a well-known prompt with a valid CRC. An engine
with a secret reads a page only if its MAC verifies; a page without one
(written by an engine without the secret, or planted) or with a wrong one
(another secret, forged) is "unauthenticated": removed and counted like a
corrupt page, never loaded. A damaged page still reads as "corrupt" (with a
secret the MAC is checked first, and the CRC only when it fails, to tell
damage from forgery: a verified MAC already proves the bytes intact). An
engine without a secret verifies the CRC only and accepts MAC'd pages (it
cannot check them; it trusts any valid page anyway), warning once that pages
carry a MAC it cannot verify.

Which MAC: pages are written with AES-256-GMAC (GCM authenticating only,
through the ``cryptography`` package's OpenSSL: AES-NI and carry-less
multiply), a random 96-bit nonce per page stored beside the tag; about
0.1 ms on a 2 MiB page here. Keyed BLAKE3 (a PRF, no nonce; about 0.35 ms
here, 0.27 ms on a quiet machine), what pages were written with before, is
still verified, as the header names the algorithm. Both beat HMAC-SHA256
(1.2 ms, SHA-NI) and keyed BLAKE2b (2.2 ms): benchmarks/bench_page_mac.py,
docs/benchmarks.md. blake3 and cryptography are dependencies of vLLM and
LMCache. Each algorithm's key is derived from the secret with BLAKE3's key
derivation mode (its own context), so any secret length works and the secret
itself never keys anything.

Checksum: CRC-32 (zlib's polynomial) through ISA-L's AVX-512/PCLMUL kernel
(the ``isal`` package), about 45 GB/s on a 2 MiB page here, GIL released:
a page read from the page cache costs about a tenth more, where google-crc32c's
CRC-32C (about 7.5 GB/s: one crc32 instruction chain) cost two thirds more
and zlib.crc32 (about 4.5 GB/s) more than the read. Without isal, CRC-32C is
written through google-crc32c's libcrc32c (an LMCache dependency), else
zlib.crc32. The header names the algorithm, so a reader verifies either:
CRC-32 pages with isal or zlib, CRC-32C pages with libcrc32c.

The namespace (model, dtype, layout, ... as given by the caller) and the
block size are hashed into the LMCache model name ``kvbm_<16 hex>`` (LMCache
keys are limited to 150 characters), so another namespace never matches a
key; the same hash is also checked in the header.

This module does not import LMCache: the scheduler process uses it too (the
disk tier's page names are its index of the disk).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import hashlib
import hmac
import logging
import os
import struct
import zlib
from typing import Callable

import numpy as np
import torch

logger = logging.getLogger(__name__)

_MAGIC = b"KVBT"
# 2: the MAC field and its algorithm. A page of another version is "corrupt"
# (and under another name: the version is part of the namespace hash).
_VERSION = 2
_ALG_CRC32 = 1     # zlib.crc32 (computed with ISA-L where installed)
_ALG_CRC32C = 2    # Castagnoli, hardware accelerated
_FLAG_TOMBSTONE = 1
_FLAG_MAC = 2      # the mac field holds a MAC made with the deployment secret
_FLAGS = _FLAG_TOMBSTONE | _FLAG_MAC
_MAC_NONE = 0
_MAC_BLAKE3 = 1    # keyed BLAKE3, 32 bytes
_MAC_GMAC = 2      # AES-256-GMAC: 12-byte nonce, 16-byte tag, 4 zero bytes
_MAC_ALGS = (_MAC_BLAKE3, _MAC_GMAC)
_GMAC_NONCE, _GMAC_TAG = 12, 16
MAC_BYTES = 32
_NO_MAC = bytes(MAC_BYTES)
# magic, version, crc algorithm, flags, mac algorithm, payload length,
# namespace hash, key, mac, crc
_HDR = struct.Struct("<4sHHHHQ8s32s32sI")
HEADER_BYTES = _HDR.size  # 96
_CRC_OFF = HEADER_BYTES - 4
_MAC_OFF = _CRC_OFF - MAC_BYTES  # the MAC covers the header before this
KEY_BYTES = 32
# A secret shorter than this is refused at startup (config.py).
MIN_SECRET_BYTES = 16
_MAC_CONTEXT = "vllm_kvbm page MAC v2 (keyed BLAKE3 over namespace, header, payload)"
_GMAC_CONTEXT = "vllm_kvbm page MAC v2 (AES-256-GMAC over namespace, header, payload)"
# Disk space one page takes: the file is header + payload, and LMCache's
# allocator and disk accounting charge it in whole 4 KiB pages.
_DISK_UNIT = 4096


def disk_page_bytes(block_bytes: int) -> int:
    """Bytes of disk capacity one block's page is charged (the one formula)."""
    return -(-(HEADER_BYTES + block_bytes) // _DISK_UNIT) * _DISK_UNIT


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


_crc32c_extend = _load_crc32c()
_crc32, _FAST_CRC32 = _load_crc32()
_WRITE_ALG = (_ALG_CRC32 if _FAST_CRC32 or _crc32c_extend is None else _ALG_CRC32C)


def checksum_name() -> str:
    """The checksum pages are written with here, and by what (for reports)."""
    if _WRITE_ALG == _ALG_CRC32C:
        return "CRC-32C (libcrc32c)"
    return "CRC-32 (ISA-L)" if _FAST_CRC32 else "CRC-32 (zlib)"


def _checksum(alg: int, prefix: bytes, payload: "torch.Tensor | memoryview") -> int | None:
    """CRC over the header prefix, then the payload (1-D contiguous uint8 CPU
    tensor, or a byte memoryview); None for an algorithm not available here."""
    if alg not in (_ALG_CRC32, _ALG_CRC32C) or (alg == _ALG_CRC32C and _crc32c_extend is None):
        return None
    crc = _Crc(alg, prefix)
    if isinstance(payload, torch.Tensor):
        payload = memoryview(payload.numpy()) if payload.numel() else b""
    crc.update(payload)
    return crc.value


def _nbytes(payload: "torch.Tensor | memoryview") -> int:
    return payload.numel() if isinstance(payload, torch.Tensor) else len(payload)


def _namespace_hash(namespace: str, block_bytes: int, version: int = _VERSION) -> bytes:
    return hashlib.sha256(f"kvbm-tier|v{version}|{block_bytes}|{namespace}".encode()).digest()[:8]


def retired_model_names(namespace: str, block_bytes: int) -> list[str]:
    """The LMCache model names this namespace's pages had in older page format
    versions (the disk tier deletes such files: no engine of this version reads them)."""
    return ["kvbm_" + _namespace_hash(namespace, block_bytes, v).hex() for v in range(1, _VERSION)]



def page_namer(namespace: str, block_bytes: int, rank: int,
               world_size: int) -> Callable[[bytes], str]:
    """``key -> name`` a tier stores ``key``'s page under for one TP rank.

    It is LMCache's ``CacheEngineKey.to_string()`` of the key the stores use
    (model ``kvbm_<namespace hash>``, dtype uint8), written out here so the
    scheduler process can name pages without importing LMCache; a test checks
    that the two agree. The namespace part is computed once: lookups name
    pages on the scheduler's hot path.
    """
    prefix = f"kvbm_{_namespace_hash(namespace, block_bytes).hex()}@{world_size}@{rank}@"
    return lambda key: f"{prefix}{int.from_bytes(key, 'big'):x}@uint8"


def page_name(namespace: str, block_bytes: int, rank: int, world_size: int,
              key: bytes) -> str:
    return page_namer(namespace, block_bytes, rank, world_size)(key)


def disk_page_namer(directory: str, namespace: str, block_bytes: int, rank: int,
                    world_size: int) -> Callable[[bytes], str]:
    """``key -> path`` of the file the disk store keeps ``key``'s page in.

    Files appear only complete (written as ``.tmp`` and renamed) and vanish
    on eviction, so a reader in another process may treat existence as "on
    disk" (the content is still verified when read).
    """
    name = page_namer(namespace, block_bytes, rank, world_size)
    base = os.path.join(os.path.abspath(os.path.expanduser(directory)), "")
    return lambda key: f"{base}{name(key)}.pt"


def disk_page_path(directory: str, namespace: str, block_bytes: int, rank: int,
                   world_size: int, key: bytes) -> str:
    return disk_page_namer(directory, namespace, block_bytes, rank, world_size)(key)


def _mac_key(secret: bytes, context: str) -> bytes:
    """A 32-byte key for one MAC algorithm, derived from the deployment secret
    (any length works, and the secret itself never keys anything)."""
    import blake3  # a dependency of vLLM and LMCache

    if not isinstance(secret, (bytes, bytearray)) or len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the page secret must be at least {MIN_SECRET_BYTES} bytes")
    return blake3.blake3(bytes(secret), derive_key_context=context).digest()


def _scope(namespace: str, block_bytes: int) -> bytes:
    """What every MAC covers first: length-prefixed, so no two (namespace,
    block size) pairs feed the same bytes."""
    ns = namespace.encode()
    return struct.pack("<Q", len(ns)) + ns + struct.pack("<Q", block_bytes)


class _PageMac:
    """A MAC algorithm: signer(fields) and verifier(fields, mac) streams that
    take the payload a chunk at a time."""

    def digest(self, fields: bytes, payload: torch.Tensor) -> bytes:
        """The MAC field of a page (benchmarks: the whole computation at once)."""
        stream = self.signer(fields)
        if payload.numel():
            stream.update(memoryview(payload.numpy()))
        return stream.field()


class _Blake3Mac(_PageMac):
    """Keyed BLAKE3 over (namespace, block size, header fields, payload): the
    MAC field is the 32-byte digest."""

    alg = _MAC_BLAKE3

    def __init__(self, secret: bytes, namespace: str, block_bytes: int):
        import blake3

        self._base = blake3.blake3(key=_mac_key(secret, _MAC_CONTEXT))
        self._base.update(_scope(namespace, block_bytes))

    def __repr__(self) -> str:
        return "_Blake3Mac(<keyed>)"

    def signer(self, fields: bytes) -> "_Blake3Stream":
        h = self._base.copy()
        h.update(fields)
        return _Blake3Stream(h)

    def verifier(self, fields: bytes, mac: bytes) -> "_Blake3Stream":
        stream = self.signer(fields)
        stream.want = mac
        return stream


class _Blake3Stream:
    want = b""

    def __init__(self, h):
        self._h = h

    def update(self, chunk: memoryview) -> None:
        self._h.update(chunk)

    def field(self) -> bytes:
        return self._h.digest()

    def ok(self) -> bool:
        return hmac.compare_digest(self._h.digest(), self.want)


class _GmacMac(_PageMac):
    """AES-256-GMAC (GCM authenticating, encrypting nothing) over (namespace,
    block size, header fields, payload): the MAC field is a random 96-bit
    nonce, the 128-bit tag and 4 zero bytes. About 3.5x keyed BLAKE3's speed
    here (AES-NI and carry-less multiply through OpenSSL): what pages are
    written with. A random nonce per page keeps the GCM bound (2^32 pages per
    key) far beyond any cache's lifetime."""

    alg = _MAC_GMAC

    def __init__(self, secret: bytes, namespace: str, block_bytes: int):
        from cryptography.hazmat.primitives.ciphers import algorithms  # an LMCache dependency

        self._aes = algorithms.AES(_mac_key(secret, _GMAC_CONTEXT))
        self._scope = _scope(namespace, block_bytes)

    def __repr__(self) -> str:
        return "_GmacMac(<keyed>)"

    def _stream(self, mode, fields: bytes, nonce: bytes, verify: bool) -> "_GmacStream":
        from cryptography.hazmat.primitives.ciphers import Cipher

        cipher = Cipher(self._aes, mode)
        ctx = cipher.decryptor() if verify else cipher.encryptor()
        ctx.authenticate_additional_data(self._scope + fields)
        return _GmacStream(ctx, nonce)

    def signer(self, fields: bytes) -> "_GmacStream":
        from cryptography.hazmat.primitives.ciphers import modes

        nonce = os.urandom(_GMAC_NONCE)
        return self._stream(modes.GCM(nonce), fields, nonce, verify=False)

    def verifier(self, fields: bytes, mac: bytes) -> "_GmacStream | _Refused":
        from cryptography.hazmat.primitives.ciphers import modes

        nonce, tag, pad = (mac[:_GMAC_NONCE], mac[_GMAC_NONCE:_GMAC_NONCE + _GMAC_TAG],
                           mac[_GMAC_NONCE + _GMAC_TAG:])
        if any(pad):
            return _Refused()
        return self._stream(modes.GCM(nonce, tag), fields, nonce, verify=True)


class _GmacStream:
    def __init__(self, ctx, nonce: bytes):
        self._ctx, self._nonce = ctx, nonce

    def update(self, chunk: memoryview) -> None:
        self._ctx.authenticate_additional_data(chunk)

    def field(self) -> bytes:
        self._ctx.finalize()
        return self._nonce + self._ctx.tag + bytes(MAC_BYTES - _GMAC_NONCE - _GMAC_TAG)

    def ok(self) -> bool:
        from cryptography.exceptions import InvalidTag

        try:
            self._ctx.finalize()
            return True
        except InvalidTag:
            return False


class _Refused:
    """A MAC field no key could have made: fails without computing anything."""

    def update(self, chunk: memoryview) -> None:
        pass

    def ok(self) -> bool:
        return False


class _Macs:
    """The deployment's page MACs: pages are written with GMAC; both GMAC
    and BLAKE3 pages (written before GMAC) are verified."""

    def __init__(self, secret: bytes, namespace: str, block_bytes: int):
        self.sign = _GmacMac(secret, namespace, block_bytes)
        self.by_alg = {_MAC_GMAC: self.sign,
                       _MAC_BLAKE3: _Blake3Mac(secret, namespace, block_bytes)}

    def __repr__(self) -> str:
        return "_Macs(<keyed>)"


class PageCodec:
    """Encodes/verifies ``header + payload`` pages for one namespace.

    ``secret`` (bytes, at least MIN_SECRET_BYTES; None: no MAC) is the
    deployment's page secret: pages are written with a MAC, and only pages
    whose MAC verifies are read ("unauthenticated" otherwise).
    """

    def __init__(self, namespace: str, block_bytes: int, secret: bytes | None = None):
        self.ns8 = _namespace_hash(namespace, block_bytes)
        self.model_name = "kvbm_" + self.ns8.hex()
        self.block_bytes = block_bytes
        self.stored_bytes = HEADER_BYTES + block_bytes
        self._macs = None if secret is None else _Macs(secret, namespace, block_bytes)
        self._warned_unverified = False

    @property
    def keyed(self) -> bool:
        """True if this codec writes and requires page MACs."""
        return self._macs is not None

    def _header(self, key: bytes, flags: int, payload: torch.Tensor) -> bytes:
        signer = PageSigner(self, key, flags, payload.numel())
        if payload.numel():
            signer.update(memoryview(payload.numpy()))
        return signer.header(payload)

    def encode_into(self, buf: torch.Tensor, key: bytes, page: torch.Tensor) -> None:
        """buf: 1-D uint8 of stored_bytes. Copies page, then checksums the copy."""
        payload = buf[HEADER_BYTES:]
        copy_bytes(payload, page)
        hdr = self._header(key, 0, payload)
        ctypes.memmove(buf.data_ptr(), hdr, HEADER_BYTES)

    def encode_tombstone(self, buf: torch.Tensor, key: bytes) -> None:
        hdr = self._header(key, _FLAG_TOMBSTONE, buf[HEADER_BYTES:HEADER_BYTES])
        ctypes.memmove(buf.data_ptr(), hdr, HEADER_BYTES)

    def signer(self, key: bytes) -> "PageSigner":
        """The header of a data page computed as its payload goes by, a chunk
        at a time (the disk tier checksums each chunk right after writing it,
        while it is in cache), then finished with ``header(payload)``."""
        return PageSigner(self, key, 0, self.block_bytes)


    def decode_into(self, buf: torch.Tensor, key: bytes, out: torch.Tensor) -> str:
        """Verifies buf (1-D uint8) against key; copies the payload into out on success.

        -> "ok" | "miss" (a tombstone) | "corrupt" (damaged, another version,
        key or namespace) | "unauthenticated" (intact, but this codec has a
        secret and the page has no MAC or a wrong one) | "error".
        """
        if buf.numel() < HEADER_BYTES:
            return "corrupt"
        payload = buf[HEADER_BYTES:]
        status = self.verify(buf[:HEADER_BYTES].numpy().tobytes(), key, payload)
        if status == "ok":
            copy_bytes(out, payload)
        return status

    def verify(self, hdr: bytes, key: bytes, payload: torch.Tensor) -> str:
        """decode_into's checks on a page read apart: ``hdr`` (HEADER_BYTES) and
        ``payload`` (1-D contiguous uint8 CPU, already where it is wanted, e.g. a
        host slot). Same results; "ok" means the payload may be used as it is.
        """
        check = self.start_verify(hdr, key)
        if isinstance(check, str):
            return check
        if payload.numel():
            check.update(memoryview(payload.numpy()))
        return check.finish(payload)

    def start_verify(self, hdr: bytes, key: bytes) -> "str | PageCheck":
        """Checks the header alone: a status if it already decides the page
        ("corrupt"), else a PageCheck to feed the payload to as it arrives
        (the disk tier checks each chunk right after reading it, while it is
        still in the CPU's cache)."""
        if len(hdr) != HEADER_BYTES:
            return "corrupt"
        if hdr[:4] != _MAGIC or int.from_bytes(hdr[4:6], "little") != _VERSION:
            return "corrupt"  # checked before the layout below is assumed
        magic, version, alg, flags, mac_alg, plen, ns8, k, mac, crc = _HDR.unpack(hdr)
        if ns8 != self.ns8 or k != key:
            return "corrupt"
        if flags & ~_FLAGS:
            return "corrupt"
        if flags & _FLAG_MAC:
            if mac_alg not in _MAC_ALGS:
                return "corrupt"
        elif mac_alg != _MAC_NONE or mac != _NO_MAC:
            return "corrupt"
        want_len = 0 if flags & _FLAG_TOMBSTONE else self.block_bytes
        if plen != want_len:
            return "corrupt"
        if alg not in (_ALG_CRC32, _ALG_CRC32C):
            return "corrupt"  # not an algorithm any version writes
        if alg == _ALG_CRC32C and _crc32c_extend is None:
            return "error"  # written with an algorithm this process cannot compute
        return PageCheck(self, hdr, alg, flags, mac_alg, plen, mac, crc)

    def _warn_unverified(self) -> None:
        if not self._warned_unverified:
            self._warned_unverified = True
            logger.warning(
                "KVBM: pages in this tier carry a MAC, but this engine has no page secret, so "
                "it cannot verify where they came from and accepts any page with a valid "
                "checksum; set the same page_secret_file (or KVBM_PAGE_SECRET) on every engine "
                "sharing the tier")


class PageSigner:
    """Without a secret the CRC follows the chunks; with one the MAC does
    (the CRC covers the MAC, so it needs a pass of its own at the end)."""

    def __init__(self, codec: PageCodec, key: bytes, flags: int, plen: int):
        self._codec, self._seen, self._plen = codec, 0, plen
        mac_alg = _MAC_NONE
        if codec._macs is not None:
            flags, mac_alg = flags | _FLAG_MAC, codec._macs.sign.alg
        self._prefix = _HDR.pack(_MAGIC, _VERSION, _WRITE_ALG, flags, mac_alg, plen,
                                 codec.ns8, key, _NO_MAC, 0)[:_MAC_OFF]
        if codec._macs is not None:
            self._h = codec._macs.sign.signer(self._prefix)
        else:
            self._h = _Crc(_WRITE_ALG, self._prefix + _NO_MAC)

    def update(self, chunk: memoryview) -> None:
        self._seen += len(chunk)
        self._h.update(chunk)

    def header(self, payload: torch.Tensor) -> bytes:
        """The header, once every byte of ``payload`` went through update."""
        assert self._seen == payload.numel() == self._plen
        if self._codec._macs is None:
            return self._prefix + _NO_MAC + struct.pack("<I", self._h.value)
        prefix = self._prefix + self._h.field()
        return prefix + struct.pack("<I", _checksum(_WRITE_ALG, prefix, payload))


class PageCheck:
    """A page's payload checks, fed in order as the bytes arrive.

    With a secret and a MAC'd page, the MAC alone is computed (a verified
    MAC already proves the bytes intact); only when it fails is the CRC
    computed too, over the whole payload, to tell damage ("corrupt") from
    forgery ("unauthenticated"). Otherwise the CRC alone.
    """

    def __init__(self, codec: PageCodec, hdr: bytes, alg: int, flags: int, mac_alg: int,
                 plen: int, mac: bytes, crc: int):
        self._codec, self._hdr, self._alg, self._flags = codec, hdr, alg, flags
        self._plen, self._crc, self._seen = plen, crc, 0
        self._by_mac = codec._macs is not None and bool(flags & _FLAG_MAC)
        if self._by_mac:
            self._h = codec._macs.by_alg[mac_alg].verifier(hdr[:_MAC_OFF], mac)
        else:
            self._h = _Crc(alg, hdr[:_CRC_OFF])

    def update(self, chunk: memoryview) -> None:
        """The next bytes of the payload (a memoryview: slicing one costs
        nothing, where a tensor slice costs microseconds per chunk)."""
        self._seen += len(chunk)
        self._h.update(chunk)

    def finish(self, payload: "torch.Tensor | memoryview") -> str:
        """The status, once every byte went through update; ``payload`` is the
        whole payload (read again only when a MAC fails): a tensor or a byte
        memoryview (the disk's reader threads keep torch out of their loop:
        tensor calls there cost warm reads in flight 10-20%)."""
        codec = self._codec
        if self._seen != self._plen or _nbytes(payload) != self._plen:
            return "corrupt"
        if self._by_mac:
            if self._h.ok():
                return "miss" if self._flags & _FLAG_TOMBSTONE else "ok"
            crc = _checksum(self._alg, self._hdr[:_CRC_OFF], payload)
        else:
            crc = self._h.value
        if crc != self._crc:
            return "corrupt"  # damaged (whether or not it was authentic)
        if codec._macs is not None:
            return "unauthenticated"  # intact, but no MAC or a wrong one
        if self._flags & _FLAG_MAC:
            codec._warn_unverified()
        return "miss" if self._flags & _FLAG_TOMBSTONE else "ok"


class _Crc:
    """An incremental page checksum (the algorithm named in the header)."""

    def __init__(self, alg: int, prefix: bytes):
        self._alg = alg
        self.value = (_crc32c_extend(0, prefix, len(prefix)) if alg == _ALG_CRC32C
                      else _crc32(prefix))

    def update(self, chunk: memoryview) -> None:
        if not len(chunk):
            return
        if self._alg == _ALG_CRC32C:
            addr = np.frombuffer(chunk, dtype=np.uint8).ctypes.data
            self.value = _crc32c_extend(self.value, addr, len(chunk))
        else:
            self.value = _crc32(chunk, self.value)


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


def valid_page(t, block_bytes: int) -> bool:
    return (isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1
            and t.device.type == "cpu" and t.numel() == block_bytes)

