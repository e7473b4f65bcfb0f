"""The page format every lower tier stores, and what the tiers name a page.

A page is stored as ``HEADER (96 B) + payload``. The header holds a magic, a
format version, the checksum algorithm, flags, the seal algorithm, the
payload length, an 8-byte hash of what the page belongs to, the 32-byte key
(zeros on a sealed page), a 32-byte seal field and, last, a CRC over the
header before the seal field, the stored payload and the seal field (in that
order, so a writer and a reader compute it in one pass as the bytes go by).
``decode_into`` checks all of them, so a flipped byte, a truncated page, or a
page filed under another key, namespace or TP rank is "corrupt", never "ok".

What a page belongs to (format version 3): the header's 8-byte field hashes
the namespace, the page's size, the TP rank and world size, and the worker's
KV cache layout (``layout``: a fingerprint of the registered KV tensors, see
worker/tier_io.py). A rank's page moved to another rank's name, or read by an
engine whose KV cache is laid out otherwise, is "corrupt". A page's NAME
depends on the namespace, the page size, the rank and world size only, so
the scheduler process (which has no KV cache) names pages too.

Sealed pages: with a deployment secret (``page_secret_file`` /
``KVBM_PAGE_SECRET``) every payload is encrypted and authenticated in one
pass with AES-256-GCM (``cryptography``'s OpenSSL: AES-NI and carry-less
multiply), a random 96-bit nonce per page stored beside the 128-bit tag in
the seal field. The authenticated data is everything the header check covers
(namespace, page size, rank, world size, layout, header fields) and the page
key, which the header does not carry in the clear. Each page is encrypted
under its own AES key, derived from the secret and the page key: a page key
includes the request's ``cache_salt``, so a tenant's pages open only under
its own salt. Page names are keyed too (keyed BLAKE3 of the namespace and
the page key, under a key derived from the secret), so a reader of the disk
directory or the remote server who holds no secret learns neither the KV
bytes nor whether a prompt it knows was served (it cannot compute the name
to look for). An engine with a secret reads a page only if it opens:
a page that is not sealed (written without the secret, or planted) or
sealed under another secret, salt, rank or layout (forged or moved) is
"unauthenticated": removed and counted like a corrupt page, never loaded. A
damaged page still reads as "corrupt": when the tag fails, the stored bytes
are recovered (encrypted again with the same keystream) and checksummed, to
tell damage from forgery; an opened page needs no checksum. An engine
without a secret cannot open sealed pages ("unauthenticated", warned once).
Costs against a page read: benchmarks/bench_page_mac.py, docs/benchmarks.md.
Keys are derived from the secret with BLAKE3's key derivation mode (a
context each), so any secret length works and the secret itself never keys
anything. Pages of format version 2 (GMAC or BLAKE3 MACs, payload in the
clear) are "corrupt", and are named differently (the version is in the name).

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
key.

This module does not import LMCache: the scheduler process uses it too (the
disk tier's page names are its index of the disk).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import hashlib
import logging
import os
import struct
import zlib
from typing import Callable

import numpy as np
import torch

logger = logging.getLogger(__name__)

_MAGIC = b"KVBT"
# 3: sealed payloads (AES-256-GCM), keyed names, the rank and the KV layout
# in the header check. A page of another version is "corrupt" (and under
# another name: the version is part of the namespace hash).
_VERSION = 3
_ALG_CRC32 = 1     # zlib.crc32 (computed with ISA-L where installed)
_ALG_CRC32C = 2    # Castagnoli, hardware accelerated
_FLAG_TOMBSTONE = 1
_FLAG_SEALED = 2   # payload encrypted and authenticated with the deployment secret
_FLAG_MAC = _FLAG_SEALED
_FLAGS = _FLAG_TOMBSTONE | _FLAG_SEALED
_MAC_NONE = 0
_MAC_BLAKE3 = 1    # version 2 only (keyed BLAKE3): never read
_MAC_GMAC = 2      # version 2 only (AES-256-GMAC): never read
_MAC_AES_GCM = 3   # AES-256-GCM: 12-byte nonce, 16-byte tag, 4 zero bytes
_GCM_NONCE, _GCM_TAG = 12, 16
MAC_BYTES = 32
_NO_MAC = bytes(MAC_BYTES)
KEY_BYTES = 32
_NO_KEY = bytes(KEY_BYTES)
# magic, version, crc algorithm, flags, seal algorithm, payload length,
# namespace hash, key, seal (nonce + tag), crc
_HDR = struct.Struct("<4sHHHHQ8s32s32sI")
HEADER_BYTES = _HDR.size  # 96
_CRC_OFF = HEADER_BYTES - 4
_MAC_OFF = _CRC_OFF - MAC_BYTES  # the authenticated header fields end here
# A secret shorter than this is refused at startup (config/secrets.py).
MIN_SECRET_BYTES = 16
_SEAL_CONTEXT = "vllm_kvbm page v3: AES-256-GCM page keys"
_NAME_CONTEXT = "vllm_kvbm page v3: page names"
# Disk space one page takes: the file is header + payload, and LMCache's
# allocator and disk accounting charge it in whole 4 KiB pages.
_DISK_UNIT = 4096


def disk_page_bytes(page_bytes: int) -> int:
    """Bytes of disk capacity one block's page is charged (the one formula)."""
    return -(-(HEADER_BYTES + page_bytes) // _DISK_UNIT) * _DISK_UNIT


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


def _bytes_view(payload: "torch.Tensor | memoryview") -> memoryview:
    if isinstance(payload, torch.Tensor):
        return memoryview(payload.numpy()) if payload.numel() else memoryview(bytearray())
    return payload


def _namespace_hash(namespace: str, page_bytes: int, version: int = _VERSION) -> bytes:
    return hashlib.sha256(f"kvbm-tier|v{version}|{page_bytes}|{namespace}".encode()).digest()[:8]


def retired_model_names(namespace: str, page_bytes: int) -> list[str]:
    """The LMCache model names this namespace's pages had in older page format
    versions (the disk tier deletes such files: no engine of this version reads them)."""
    return ["kvbm_" + _namespace_hash(namespace, page_bytes, v).hex() for v in range(1, _VERSION)]


def _derived_key(secret: bytes, context: str) -> bytes:
    """A 32-byte key for one use, derived from the deployment secret (any
    length works, and the secret itself never keys anything)."""
    import blake3  # a dependency of vLLM and LMCache

    if not isinstance(secret, (bytes, bytearray)) or len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the page secret must be at least {MIN_SECRET_BYTES} bytes")
    return blake3.blake3(bytes(secret), derive_key_context=context).digest()


def _lp(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def _name_scope(namespace: str, page_bytes: int) -> bytes:
    """What names depend on: length-prefixed, so no two pairs feed the same bytes."""
    return _lp(namespace.encode()) + struct.pack("<QQ", page_bytes, _VERSION)


def _page_scope(namespace: str, page_bytes: int, rank: int, world_size: int,
                layout: str) -> bytes:
    """What a page's header check and seal cover besides its own fields."""
    return (_name_scope(namespace, page_bytes) + struct.pack("<QQ", rank, world_size)
            + _lp(layout.encode()))


class _Names:
    """What the tiers name one namespace's pages: the LMCache model name and
    each key's chunk hash (the key itself without a secret; keyed BLAKE3 of
    the namespace and the key with one, so names cannot be computed without
    the secret)."""

    def __init__(self, namespace: str, page_bytes: int, secret: bytes | None):
        self.keyed = secret is not None
        if secret is None:
            self.model = "kvbm_" + _namespace_hash(namespace, page_bytes).hex()
            self._base = None
            return
        import blake3

        scope = _name_scope(namespace, page_bytes)
        self._root = blake3.blake3(key=_derived_key(secret, _NAME_CONTEXT))
        self.model = "kvbm_" + self.tag(b"model", scope)[:8].hex()
        self._base = self._root.copy()
        self._base.update(_lp(b"page") + scope)

    def __repr__(self) -> str:
        return f"_Names(keyed={self.keyed})"

    def tag(self, label: bytes, data: bytes) -> bytes:
        h = self._root.copy()
        h.update(_lp(label) + data)
        return h.digest()

    def chunk_hash(self, key: bytes) -> int:
        """The number LMCache's key (and so the page's name) carries for ``key``."""
        if self._base is None:
            return int.from_bytes(key, "big")
        h = self._base.copy()
        h.update(key)
        return int.from_bytes(h.digest(), "big")


def page_namer(namespace: str, page_bytes: int, rank: int, world_size: int,
               secret: bytes | None = None) -> Callable[[bytes], str]:
    """``key -> name`` a tier stores ``key``'s page under for one TP rank.

    It is LMCache's ``CacheEngineKey.to_string()`` of the key the stores use
    (model ``kvbm_<namespace hash>``, dtype uint8), written out here so the
    scheduler process can name pages without importing LMCache; a test checks
    that the two agree. With ``secret`` (the page secret) the model part and
    the key part are keyed hashes. The namespace part is computed once:
    lookups name pages on the scheduler's hot path.
    """
    names = _Names(namespace, page_bytes, secret)
    prefix = f"{names.model}@{world_size}@{rank}@"
    return lambda key: f"{prefix}{names.chunk_hash(key):x}@uint8"


def page_name(namespace: str, page_bytes: int, rank: int, world_size: int,
              key: bytes, secret: bytes | None = None) -> str:
    return page_namer(namespace, page_bytes, rank, world_size, secret)(key)


def disk_page_namer(directory: str, namespace: str, page_bytes: int, rank: int,
                    world_size: int, secret: bytes | None = None) -> Callable[[bytes], str]:
    """``key -> path`` of the file the disk store keeps ``key``'s page in.

    Files appear only complete (written as ``.tmp`` and renamed) and vanish
    on eviction, so a reader in another process may treat existence as "on
    disk" (the content is still verified when read).
    """
    name = page_namer(namespace, page_bytes, rank, world_size, secret)
    base = os.path.join(os.path.abspath(os.path.expanduser(directory)), "")
    return lambda key: f"{base}{name(key)}.pt"


def disk_page_path(directory: str, namespace: str, page_bytes: int, rank: int,
                   world_size: int, key: bytes, secret: bytes | None = None) -> str:
    return disk_page_namer(directory, namespace, page_bytes, rank, world_size, secret)(key)


class _Seal:
    """AES-256-GCM for one namespace, rank and layout: each page under a key
    derived from the secret, the page scope and the page key (a keyed BLAKE3
    of about 100 bytes, about 2 us a page here against 0.2 ms to encrypt a
    2 MiB page); the authenticated data is the scope, the header fields and
    the page key. A random 96-bit nonce per page: the same key is used again
    when a page is written again, and 2^32 writes of one key stay far beyond
    a cache's lifetime."""

    alg = _MAC_AES_GCM

    def __init__(self, secret: bytes, scope: bytes):
        import blake3
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        self._cipher, self._aes, self._gcm = Cipher, algorithms.AES, modes.GCM
        self._base = blake3.blake3(key=_derived_key(secret, _SEAL_CONTEXT))
        self._base.update(_lp(scope))
        self._scope = scope

    def __repr__(self) -> str:
        return "_Seal(<keyed>)"

    def _page_key(self, key: bytes):
        h = self._base.copy()
        h.update(key)
        return self._aes(h.digest())

    def encryptor(self, key: bytes, fields: bytes):
        """-> (encryption context with the associated data fed, nonce)."""
        nonce = os.urandom(_GCM_NONCE)
        ctx = self._cipher(self._page_key(key), self._gcm(nonce)).encryptor()
        ctx.authenticate_additional_data(self._scope + fields + key)
        return ctx, nonce

    def decryptor(self, key: bytes, fields: bytes, mac: bytes):
        nonce, tag = mac[:_GCM_NONCE], mac[_GCM_NONCE:_GCM_NONCE + _GCM_TAG]
        ctx = self._cipher(self._page_key(key), self._gcm(nonce, tag)).decryptor()
        ctx.authenticate_additional_data(self._scope + fields + key)
        return ctx

    def keystream(self, key: bytes, mac: bytes):
        """A context that turns what a decryptor wrote back into the stored
        bytes (GCM's CTR keystream, the same both ways)."""
        return self._cipher(self._page_key(key), self._gcm(mac[:_GCM_NONCE])).encryptor()


class PageCodec:
    """Encodes/verifies ``header + payload`` pages for one namespace, TP rank
    and KV cache layout.

    ``secret`` (bytes, at least MIN_SECRET_BYTES; None: pages in the clear,
    CRC only) is the deployment's page secret: pages are written sealed, and
    only pages that open are read ("unauthenticated" otherwise). ``rank`` and
    ``world_size`` are the writer's TP rank and size; ``layout`` a fingerprint
    of its KV cache layout (any string; "" where unknown): a page verifies
    only where all of them are the writer's.
    """

    def __init__(self, namespace: str, page_bytes: int, secret: bytes | None = None, *,
                 rank: int = 0, world_size: int = 1, layout: str = ""):
        self.names = _Names(namespace, page_bytes, secret)
        self.model_name = self.names.model
        self.page_bytes = page_bytes
        self.stored_bytes = HEADER_BYTES + page_bytes
        scope = _page_scope(namespace, page_bytes, rank, world_size, layout)
        if secret is None:
            self.ns8 = hashlib.sha256(b"kvbm-page|" + scope).digest()[:8]
            self._seal = None
        else:
            self.ns8 = self.names.tag(b"header", scope)[:8]
            self._seal = _Seal(secret, scope)
        self._warned_sealed = False

    @property
    def keyed(self) -> bool:
        """True if this codec writes and requires sealed pages."""
        return self._seal is not None

    def chunk_hash(self, key: bytes) -> int:
        return self.names.chunk_hash(key)

    def encode_into(self, buf: torch.Tensor, key: bytes, page: torch.Tensor) -> None:
        """buf: 1-D uint8 of stored_bytes. Writes the page (encrypted from
        ``page`` straight into ``buf`` with a secret), then its header."""
        payload = buf[HEADER_BYTES:]
        signer = PageSigner(self, key, 0, self.page_bytes)
        out = _bytes_view(payload)
        if self._seal is not None:
            signer.seal(_bytes_view(page), out)
        else:
            copy_bytes(payload, page)
            signer.seal(out, out)
        ctypes.memmove(buf.data_ptr(), signer.header(), HEADER_BYTES)

    def encode_tombstone(self, buf: torch.Tensor, key: bytes) -> None:
        hdr = PageSigner(self, key, _FLAG_TOMBSTONE, 0).header()
        ctypes.memmove(buf.data_ptr(), hdr, HEADER_BYTES)

    def signer(self, key: bytes) -> "PageSigner":
        """The header of a data page computed as its payload goes by, a chunk
        at a time (``seal``: the disk tier encrypts and checksums each chunk
        right before writing it), then finished with ``header()``."""
        return PageSigner(self, key, 0, self.page_bytes)

    def decode_into(self, buf: torch.Tensor, key: bytes, out: torch.Tensor) -> str:
        """Verifies buf (1-D uint8) against key; the payload goes into out.

        -> "ok" | "miss" (a tombstone) | "corrupt" (damaged, another version,
        key, namespace, rank or layout) | "unauthenticated" (intact, but not
        sealed with this codec's secret, or sealed while this codec has
        none) | "error". A sealed page is decrypted straight into ``out``,
        so on anything but "ok" ``out`` may hold anything.
        """
        if buf.numel() < HEADER_BYTES:
            return "corrupt"
        payload = buf[HEADER_BYTES:]
        check = self.start_verify(buf[:HEADER_BYTES].numpy().tobytes(), key)
        if isinstance(check, str):
            return check
        if check.opens and payload.numel():  # a sealed data page
            if payload.numel() != out.numel():
                return "corrupt"
            check.update_into(_bytes_view(payload), _bytes_view(out))
            return check.finish(out)
        if payload.numel():
            check.update(_bytes_view(payload))
        status = check.finish(payload)
        if status == "ok":
            copy_bytes(out, payload)
        return status

    def verify(self, hdr: bytes, key: bytes, payload: torch.Tensor) -> str:
        """decode_into's checks on a page read apart: ``hdr`` (HEADER_BYTES) and
        ``payload`` (1-D contiguous uint8 CPU, already where it is wanted, e.g. a
        host slot; a sealed one is decrypted in place). Same results; "ok"
        means the payload may be used as it is.
        """
        check = self.start_verify(hdr, key)
        if isinstance(check, str):
            return check
        if payload.numel():
            check.update(_bytes_view(payload))
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
        if flags & ~_FLAGS:
            return "corrupt"
        # Under a secret the field is a keyed hash, like a tag: an intact page
        # whose field is not this codec's was not sealed for this namespace,
        # rank and layout under this secret ("unauthenticated", as the
        # checksum then tells). Without one on either side, a mismatch is a
        # page of another namespace, rank or layout.
        foreign = ns8 != self.ns8
        if foreign and self._seal is None and not flags & _FLAG_SEALED:
            return "corrupt"
        if flags & _FLAG_SEALED:
            # Sealed pages do not carry their key: it is authenticated instead.
            if mac_alg != _MAC_AES_GCM or k != _NO_KEY or any(mac[_GCM_NONCE + _GCM_TAG:]):
                return "corrupt"
        elif mac_alg != _MAC_NONE or mac != _NO_MAC or k != key:
            return "corrupt"
        want_len = 0 if flags & _FLAG_TOMBSTONE else self.page_bytes
        if plen != want_len:
            return "corrupt"
        if alg not in (_ALG_CRC32, _ALG_CRC32C):
            return "corrupt"  # not an algorithm any version writes
        if alg == _ALG_CRC32C and _crc32c_extend is None:
            return "error"  # written with an algorithm this process cannot compute
        return PageCheck(self, hdr, key, alg, flags, plen, mac, crc, foreign)

    def _warn_sealed(self) -> None:
        if not self._warned_sealed:
            self._warned_sealed = True
            logger.warning(
                "KVBM: pages in this tier are sealed with a page secret this engine does not "
                "have, so it cannot read them; set the same page_secret_file (or "
                "KVBM_PAGE_SECRET) on every engine sharing the tier")


class PageSigner:
    """A page's header, computed as its payload goes by: encrypted with a
    secret (into the caller's buffer), then checksummed as stored."""

    def __init__(self, codec: PageCodec, key: bytes, flags: int, plen: int):
        self._seen, self._plen = 0, plen
        mac_alg, key_field = _MAC_NONE, key
        if codec._seal is not None:
            flags, mac_alg, key_field = flags | _FLAG_SEALED, _MAC_AES_GCM, _NO_KEY
        self._prefix = _HDR.pack(_MAGIC, _VERSION, _WRITE_ALG, flags, mac_alg, plen,
                                 codec.ns8, key_field, _NO_MAC, 0)[:_MAC_OFF]
        self._crc = _Crc(_WRITE_ALG, self._prefix)
        self._ctx = None
        if codec._seal is not None:
            self._ctx, self._nonce = codec._seal.encryptor(key, self._prefix)

    def seal(self, chunk: memoryview, out: memoryview) -> memoryview:
        """The stored bytes of the payload's next ``chunk``: encrypted into
        ``out`` (at least as long; may be ``chunk`` itself) with a secret,
        ``chunk`` itself without one. Checksummed either way."""
        n = len(chunk)
        self._seen += n
        if self._ctx is None or not n:
            self._crc.update(chunk)
            return chunk
        dst = out[:n]
        self._ctx.update_into(chunk, dst)
        self._crc.update(dst)
        return dst

    def header(self, payload: "torch.Tensor | None" = None) -> bytes:
        """The header, once every byte of the payload went through seal."""
        assert self._seen == self._plen
        mac = _NO_MAC
        if self._ctx is not None:
            self._ctx.finalize()
            mac = self._nonce + self._ctx.tag + bytes(MAC_BYTES - _GCM_NONCE - _GCM_TAG)
        self._crc.update(mac)
        return self._prefix + mac + struct.pack("<I", self._crc.value)


class PageCheck:
    """A page's payload checks, fed in order as the bytes arrive.

    A sealed page read with the secret (``opens``) is decrypted as it goes
    and its tag checked at the end; the checksum is computed only when the
    tag fails, to tell damage ("corrupt") from forgery ("unauthenticated").
    Otherwise the checksum alone.
    """

    def __init__(self, codec: PageCodec, hdr: bytes, key: bytes, alg: int, flags: int,
                 plen: int, mac: bytes, crc: int, foreign: bool = False):
        self._codec, self._hdr, self._key, self._alg = codec, hdr, key, alg
        self._flags, self._plen, self._mac, self._crc_field = flags, plen, mac, crc
        self._seen, self._foreign = 0, foreign
        self.opens = codec._seal is not None and bool(flags & _FLAG_SEALED) and not foreign
        if self.opens:
            self._ctx = codec._seal.decryptor(key, hdr[:_MAC_OFF], mac)
        else:
            self._crc = _Crc(alg, hdr[:_MAC_OFF])

    def update(self, chunk: memoryview) -> None:
        """The next stored bytes of the payload, where the payload is wanted
        (a memoryview: slicing one costs nothing, where a tensor slice costs
        microseconds per chunk); a sealed page is decrypted in place."""
        self._seen += len(chunk)
        if self.opens:
            if len(chunk):
                self._ctx.update_into(chunk, chunk)
        else:
            self._crc.update(chunk)

    def update_into(self, chunk: memoryview, out: memoryview) -> None:
        """update, for stored bytes read elsewhere: decrypted into ``out``
        (only when ``opens``; otherwise the caller copies)."""
        assert self.opens
        self._seen += len(chunk)
        if len(chunk):
            self._ctx.update_into(chunk, out[:len(chunk)])

    def finish(self, payload: "torch.Tensor | memoryview") -> str:
        """The status, once every byte went through update; ``payload`` is the
        whole payload as it lies now (decrypted where the page opens; read
        again only when its tag fails): a tensor or a byte memoryview (the
        disk's reader threads keep torch out of their loop)."""
        codec = self._codec
        if self._seen != self._plen or _nbytes(payload) != self._plen:
            return "corrupt"
        if self.opens:
            from cryptography.exceptions import InvalidTag

            try:
                self._ctx.finalize()
                return "miss" if self._flags & _FLAG_TOMBSTONE else "ok"
            except InvalidTag:
                pass
            crc = self._stored_crc(_bytes_view(payload))
        else:
            self._crc.update(self._mac)
            crc = self._crc.value
        if crc != self._crc_field:
            return "corrupt"  # damaged (whether or not it was authentic)
        if codec._seal is not None or self._foreign:
            if self._flags & _FLAG_SEALED and codec._seal is None:
                codec._warn_sealed()
            return "unauthenticated"  # intact, but not sealed under this secret and scope
        if self._flags & _FLAG_SEALED:
            codec._warn_sealed()
            return "unauthenticated"  # sealed; this engine has no secret to open it
        return "miss" if self._flags & _FLAG_TOMBSTONE else "ok"

    def _stored_crc(self, plain: memoryview) -> int:
        """The checksum of the bytes as stored, from what the decryptor wrote."""
        crc = _Crc(self._alg, self._hdr[:_MAC_OFF])
        if len(plain):
            ctx = self._codec._seal.keystream(self._key, self._mac)
            scratch = memoryview(bytearray(min(len(plain), 1 << 20)))
            for off in range(0, len(plain), len(scratch)):
                part = plain[off:off + len(scratch)]
                stored = scratch[:len(part)]
                ctx.update_into(part, stored)
                crc.update(stored)
        crc.update(self._mac)
        return crc.value


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


def valid_page(t, page_bytes: int) -> bool:
    return (isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1
            and t.device.type == "cpu" and t.numel() == page_bytes)

