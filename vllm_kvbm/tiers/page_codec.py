"""Writing and checking pages: ``PageCodec`` for one namespace, TP rank and
KV cache layout, its header computed as a payload goes by (``PageSigner``)
and a page's payload checked as it arrives (``PageCheck``).

A page read back is "ok", "miss" (a tombstone), "corrupt" (damaged, another
format version, key, namespace, rank or layout: page_format.py),
"unauthenticated" (intact but not sealed under this engine's page secret:
page_seal.py) or "error" (a checksum this process cannot compute).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import struct
import threading
from typing import TYPE_CHECKING

import torch

from vllm_kvbm.tiers import page_checksum
from vllm_kvbm.tiers.page_checksum import ALG_CRC32, ALG_CRC32C, Crc
from vllm_kvbm.tiers.page_format import (
    FLAG_SEALED,
    FLAG_TOMBSTONE,
    FLAGS,
    GCM_NONCE,
    GCM_TAG,
    HDR,
    HEADER_BYTES,
    MAC_AES_GCM,
    MAC_BYTES,
    MAC_NONE,
    MAC_OFF,
    MAGIC,
    NO_KEY,
    NO_MAC,
    VERSION,
    copy_bytes,
    page_scope,
)
from vllm_kvbm.tiers.page_names import PageNames
from vllm_kvbm.tiers.page_seal import PageSeal

if TYPE_CHECKING:
    from vllm_kvbm.engine_info import EngineInfo

logger = logging.getLogger(__name__)


def _nbytes(payload: "torch.Tensor | memoryview") -> int:
    return payload.numel() if isinstance(payload, torch.Tensor) else len(payload)


# Decrypting "in place" goes through a buffer of this size per thread: small
# enough to stay in the CPU's L2 cache, so the copy back costs little.
_SCRATCH_BYTES = 256 << 10
_local = threading.local()


def _scratch() -> memoryview:
    buf = getattr(_local, "scratch", None)
    if buf is None:
        buf = _local.scratch = memoryview(bytearray(_SCRATCH_BYTES))
    return buf


def _bytes_view(payload: "torch.Tensor | memoryview") -> memoryview:
    if isinstance(payload, torch.Tensor):
        return memoryview(payload.numpy()) if payload.numel() else memoryview(bytearray())
    return payload


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

    def __init__(
        self,
        namespace: str,
        page_bytes: int,
        secret: bytes | None = None,
        *,
        rank: int = 0,
        world_size: int = 1,
        layout: str = "",
    ):
        self.names = PageNames(namespace, page_bytes, secret)
        self.model_name = self.names.model
        self.page_bytes = page_bytes
        self.stored_bytes = HEADER_BYTES + page_bytes
        scope = page_scope(namespace, page_bytes, rank, world_size, layout)
        if secret is None:
            self.ns8 = hashlib.sha256(b"kvbm-page|" + scope).digest()[:8]
            self._seal = None
        else:
            self.ns8 = self.names.tag(b"header", scope)[:8]
            self._seal = PageSeal(secret, scope)
        self._warned_sealed = False

    @classmethod
    def for_worker(
        cls, info: "EngineInfo", rank: int, secret: bytes | None, layout: str
    ) -> "PageCodec":
        """The codec of one TP rank's pages, as a worker's stores write them."""
        return cls(
            info.tier_namespace,
            info.page_bytes,
            secret,
            rank=rank,
            world_size=info.key_namespace.tp_size,
            layout=layout,
        )

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
        hdr = PageSigner(self, key, FLAG_TOMBSTONE, 0).header()
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
        if hdr[:4] != MAGIC or int.from_bytes(hdr[4:6], "little") != VERSION:
            return "corrupt"  # checked before the layout below is assumed
        magic, version, alg, flags, mac_alg, plen, ns8, k, mac, crc = HDR.unpack(hdr)
        if flags & ~FLAGS:
            return "corrupt"
        # Under a secret the field is a keyed hash, like a tag: an intact page
        # whose field is not this codec's was not sealed for this namespace,
        # rank and layout under this secret ("unauthenticated", as the
        # checksum then tells). Without one on either side, a mismatch is a
        # page of another namespace, rank or layout.
        foreign = ns8 != self.ns8
        if foreign and self._seal is None and not flags & FLAG_SEALED:
            return "corrupt"
        if flags & FLAG_SEALED:
            # Sealed pages do not carry their key: it is authenticated instead.
            if mac_alg != MAC_AES_GCM or k != NO_KEY or any(mac[GCM_NONCE + GCM_TAG :]):
                return "corrupt"
        elif mac_alg != MAC_NONE or mac != NO_MAC or k != key:
            return "corrupt"
        want_len = 0 if flags & FLAG_TOMBSTONE else self.page_bytes
        if plen != want_len:
            return "corrupt"
        if alg not in (ALG_CRC32, ALG_CRC32C):
            return "corrupt"  # not an algorithm any version writes
        if alg == ALG_CRC32C and page_checksum.crc32c_extend is None:
            return "error"  # written with an algorithm this process cannot compute
        return PageCheck(self, hdr, key, alg, flags, plen, mac, crc, foreign)

    def _warn_sealed(self) -> None:
        if not self._warned_sealed:
            self._warned_sealed = True
            logger.warning(
                "KVBM: pages in this tier are sealed with a page secret this engine does not "
                "have, so it cannot read them; set the same page_secret_file (or "
                "KVBM_PAGE_SECRET) on every engine sharing the tier"
            )


class PageSigner:
    """A page's header, computed as its payload goes by: encrypted with a
    secret (into the caller's buffer), then checksummed as stored."""

    def __init__(self, codec: PageCodec, key: bytes, flags: int, plen: int):
        self._seen, self._plen = 0, plen
        mac_alg, key_field = MAC_NONE, key
        if codec._seal is not None:
            flags, mac_alg, key_field = flags | FLAG_SEALED, MAC_AES_GCM, NO_KEY
        write_alg = page_checksum.WRITE_ALG  # looked up per page: a test switches it
        self._prefix = HDR.pack(
            MAGIC, VERSION, write_alg, flags, mac_alg, plen, codec.ns8, key_field, NO_MAC, 0
        )[:MAC_OFF]
        self._crc = Crc(write_alg, self._prefix)
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
        mac = NO_MAC
        if self._ctx is not None:
            self._ctx.finalize()
            mac = self._nonce + self._ctx.tag + bytes(MAC_BYTES - GCM_NONCE - GCM_TAG)
        self._crc.update(mac)
        return self._prefix + mac + struct.pack("<I", self._crc.value)


class PageCheck:
    """A page's payload checks, fed in order as the bytes arrive.

    A sealed page read with the secret (``opens``) is decrypted as it goes
    and its tag checked at the end; the checksum is computed only when the
    tag fails, to tell damage ("corrupt") from forgery ("unauthenticated").
    Otherwise the checksum alone.
    """

    def __init__(
        self,
        codec: PageCodec,
        hdr: bytes,
        key: bytes,
        alg: int,
        flags: int,
        plen: int,
        mac: bytes,
        crc: int,
        foreign: bool = False,
    ):
        self._codec, self._hdr, self._key, self._alg = codec, hdr, key, alg
        self._flags, self._plen, self._mac, self._crc_field = flags, plen, mac, crc
        self._seen, self._foreign = 0, foreign
        self.opens = codec._seal is not None and bool(flags & FLAG_SEALED) and not foreign
        if self.opens:
            self._ctx = codec._seal.decryptor(key, hdr[:MAC_OFF], mac)
        else:
            self._crc = Crc(alg, hdr[:MAC_OFF])

    def update(self, chunk: memoryview) -> None:
        """The next stored bytes of the payload, where the payload is wanted
        (a memoryview: slicing one costs nothing, where a tensor slice costs
        microseconds per chunk); a sealed page is decrypted in place (through
        a scratch buffer: the cipher never writes over its own input)."""
        self._seen += len(chunk)
        if not self.opens:
            self._crc.update(chunk)
            return
        # cryptography >= 51 refuses overlapping input and output: decrypt a
        # cache-sized piece into this thread's scratch, then copy it back.
        scratch = _scratch()
        for off in range(0, len(chunk), len(scratch)):
            part = chunk[off : off + len(scratch)]
            plain = scratch[: len(part)]
            self._ctx.update_into(part, plain)
            part[:] = plain

    def update_into(self, chunk: memoryview, out: memoryview) -> None:
        """update, for stored bytes read elsewhere: decrypted into ``out``
        (only when ``opens``; otherwise the caller copies)."""
        assert self.opens
        self._seen += len(chunk)
        if len(chunk):
            self._ctx.update_into(chunk, out[: len(chunk)])

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
                return "miss" if self._flags & FLAG_TOMBSTONE else "ok"
            except InvalidTag:
                pass
            crc = self._stored_crc(_bytes_view(payload))
        else:
            self._crc.update(self._mac)
            crc = self._crc.value
        if crc != self._crc_field:
            return "corrupt"  # damaged (whether or not it was authentic)
        if codec._seal is not None or self._foreign:
            if self._flags & FLAG_SEALED and codec._seal is None:
                codec._warn_sealed()
            return "unauthenticated"  # intact, but not sealed under this secret and scope
        if self._flags & FLAG_SEALED:
            codec._warn_sealed()
            return "unauthenticated"  # sealed; this engine has no secret to open it
        return "miss" if self._flags & FLAG_TOMBSTONE else "ok"

    def _stored_crc(self, plain: memoryview) -> int:
        """The checksum of the bytes as stored, from what the decryptor wrote."""
        crc = Crc(self._alg, self._hdr[:MAC_OFF])
        if len(plain):
            ctx = self._codec._seal.keystream(self._key, self._mac)
            scratch = memoryview(bytearray(min(len(plain), 1 << 20)))
            for off in range(0, len(plain), len(scratch)):
                part = plain[off : off + len(scratch)]
                stored = scratch[: len(part)]
                ctx.update_into(part, stored)
                crc.update(stored)
        crc.update(self._mac)
        return crc.value
