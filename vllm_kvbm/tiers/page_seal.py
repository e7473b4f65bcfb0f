"""Sealed pages: what a deployment's page secret keys.

With a deployment secret (``page_secret_file`` / ``KVBM_PAGE_SECRET``) every
payload is encrypted and authenticated in one pass with AES-256-GCM
(``cryptography``'s OpenSSL: AES-NI and carry-less multiply), a random
96-bit nonce per page stored beside the 128-bit tag in the seal field. The
authenticated data is everything the header check covers (namespace, page
size, rank, world size, layout, header fields) and the page key, which the
header does not carry in the clear. Each page is encrypted under its own AES
key, derived from the secret and the page key: a page key includes the
request's ``cache_salt``, so a tenant's pages open only under its own salt.
Page names are keyed too (page_names.py), so a reader of the disk directory
or the remote server who holds no secret learns neither the KV bytes nor
whether a prompt it knows was served (it cannot compute the name to look
for). An engine with a secret reads a page only if it opens: a page that is
not sealed (written without the secret, or planted) or sealed under another
secret, salt, rank or layout (forged or moved) is "unauthenticated": removed
and counted like a corrupt page, never loaded. A damaged page still reads as
"corrupt": when the tag fails, the stored bytes are recovered (encrypted
again with the same keystream) and checksummed, to tell damage from forgery;
an opened page needs no checksum. An engine without a secret cannot open
sealed pages ("unauthenticated", warned once). Costs against a page read:
benchmarks/bench_page_mac.py, docs/benchmarks.md.

Keys are derived from the secret with BLAKE3's key derivation mode (a
context each), so any secret length works and the secret itself never keys
anything. Pages of format version 2 (GMAC or BLAKE3 MACs, payload in the
clear) are "corrupt", and are named differently (the version is in the name).
"""

from __future__ import annotations

import os

from vllm_kvbm.tiers.page_format import GCM_NONCE, GCM_TAG, MAC_AES_GCM, length_prefixed

# A secret shorter than this is refused at startup (config/secrets.py).
MIN_SECRET_BYTES = 16
_SEAL_CONTEXT = "vllm_kvbm page v3: AES-256-GCM page keys"


def derived_key(secret: bytes, context: str) -> bytes:
    """A 32-byte key for one use, derived from the deployment secret (any
    length works, and the secret itself never keys anything)."""
    import blake3  # a dependency of vLLM and LMCache

    if not isinstance(secret, (bytes, bytearray)) or len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the page secret must be at least {MIN_SECRET_BYTES} bytes")
    return blake3.blake3(bytes(secret), derive_key_context=context).digest()


class PageSeal:
    """AES-256-GCM for one namespace, rank and layout: each page under a key
    derived from the secret, the page scope and the page key (a keyed BLAKE3
    of about 100 bytes, about 2 us a page here against 0.2 ms to encrypt a
    2 MiB page); the authenticated data is the scope, the header fields and
    the page key. A random 96-bit nonce per page: the same key is used again
    when a page is written again, and 2^32 writes of one key stay far beyond
    a cache's lifetime."""

    alg = MAC_AES_GCM

    def __init__(self, secret: bytes, scope: bytes):
        import blake3
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        self._cipher, self._aes, self._gcm = Cipher, algorithms.AES, modes.GCM
        self._base = blake3.blake3(key=derived_key(secret, _SEAL_CONTEXT))
        self._base.update(length_prefixed(scope))
        self._scope = scope

    def __repr__(self) -> str:
        return "PageSeal(<keyed>)"

    def _page_key(self, key: bytes):
        h = self._base.copy()
        h.update(key)
        return self._aes(h.digest())

    def encryptor(self, key: bytes, fields: bytes):
        """-> (encryption context with the associated data fed, nonce)."""
        nonce = os.urandom(GCM_NONCE)
        ctx = self._cipher(self._page_key(key), self._gcm(nonce)).encryptor()
        ctx.authenticate_additional_data(self._scope + fields + key)
        return ctx, nonce

    def decryptor(self, key: bytes, fields: bytes, mac: bytes):
        nonce, tag = mac[:GCM_NONCE], mac[GCM_NONCE : GCM_NONCE + GCM_TAG]
        ctx = self._cipher(self._page_key(key), self._gcm(nonce, tag)).decryptor()
        ctx.authenticate_additional_data(self._scope + fields + key)
        return ctx

    def keystream(self, key: bytes, mac: bytes):
        """A context that turns what a decryptor wrote back into the stored
        bytes (GCM's CTR keystream, the same both ways)."""
        return self._cipher(self._page_key(key), self._gcm(mac[:GCM_NONCE])).encryptor()
