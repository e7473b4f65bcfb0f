"""What the tiers name a page.

The namespace (model, dtype, layout, ... as given by the caller) and the
block size are hashed into the LMCache model name ``kvbm_<16 hex>`` (LMCache
keys are limited to 150 characters), so another namespace never matches a
key. With a page secret, names are keyed BLAKE3 of the namespace and the page
key, under a key derived from the secret (page_seal.py), so they cannot be
computed without it.

This module does not import LMCache: the scheduler process uses it too (the
disk tier's page names are its index of the disk).
"""

from __future__ import annotations

import os
from typing import Callable

from vllm_kvbm.tiers.page_format import length_prefixed, name_scope, namespace_hash
from vllm_kvbm.tiers.page_seal import derived_key

_NAME_CONTEXT = "vllm_kvbm page v3: page names"


class PageNames:
    """What the tiers name one namespace's pages: the LMCache model name and
    each key's chunk hash (the key itself without a secret; keyed BLAKE3 of
    the namespace and the key with one, so names cannot be computed without
    the secret)."""

    def __init__(self, namespace: str, page_bytes: int, secret: bytes | None):
        self.keyed = secret is not None
        if secret is None:
            self.model = "kvbm_" + namespace_hash(namespace, page_bytes).hex()
            self._base = None
            return
        import blake3

        scope = name_scope(namespace, page_bytes)
        self._root = blake3.blake3(key=derived_key(secret, _NAME_CONTEXT))
        self.model = "kvbm_" + self.tag(b"model", scope)[:8].hex()
        self._base = self._root.copy()
        self._base.update(length_prefixed(b"page") + scope)

    def __repr__(self) -> str:
        return f"PageNames(keyed={self.keyed})"

    def tag(self, label: bytes, data: bytes) -> bytes:
        h = self._root.copy()
        h.update(length_prefixed(label) + data)
        return h.digest()

    def chunk_hash(self, key: bytes) -> int:
        """The number LMCache's key (and so the page's name) carries for ``key``."""
        if self._base is None:
            return int.from_bytes(key, "big")
        h = self._base.copy()
        h.update(key)
        return int.from_bytes(h.digest(), "big")


def page_namer(
    namespace: str, page_bytes: int, rank: int, world_size: int, secret: bytes | None = None
) -> Callable[[bytes], str]:
    """``key -> name`` a tier stores ``key``'s page under for one TP rank.

    It is LMCache's ``CacheEngineKey.to_string()`` of the key the stores use
    (model ``kvbm_<namespace hash>``, dtype uint8), written out here so the
    scheduler process can name pages without importing LMCache; a test checks
    that the two agree. With ``secret`` (the page secret) the model part and
    the key part are keyed hashes. The namespace part is computed once:
    lookups name pages on the scheduler's hot path.
    """
    names = PageNames(namespace, page_bytes, secret)
    prefix = f"{names.model}@{world_size}@{rank}@"
    return lambda key: f"{prefix}{names.chunk_hash(key):x}@uint8"


def page_name(
    namespace: str,
    page_bytes: int,
    rank: int,
    world_size: int,
    key: bytes,
    secret: bytes | None = None,
) -> str:
    return page_namer(namespace, page_bytes, rank, world_size, secret)(key)


def disk_page_namer(
    directory: str,
    namespace: str,
    page_bytes: int,
    rank: int,
    world_size: int,
    secret: bytes | None = None,
) -> Callable[[bytes], str]:
    """``key -> path`` of the file the disk store keeps ``key``'s page in.

    Files appear only complete (written as ``.tmp`` and renamed) and vanish
    on eviction, so a reader in another process may treat existence as "on
    disk" (the content is still verified when read).
    """
    name = page_namer(namespace, page_bytes, rank, world_size, secret)
    base = os.path.join(os.path.abspath(os.path.expanduser(directory)), "")
    return lambda key: f"{base}{name(key)}.pt"


def disk_page_path(
    directory: str,
    namespace: str,
    page_bytes: int,
    rank: int,
    world_size: int,
    key: bytes,
    secret: bytes | None = None,
) -> str:
    return disk_page_namer(directory, namespace, page_bytes, rank, world_size, secret)(key)
