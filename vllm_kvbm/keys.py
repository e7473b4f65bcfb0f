"""Block keys: what a stored KV block is called in every tier.

vLLM's own block hashes are not used as keys: with the default hash they are
seeded from PYTHONHASHSEED (random per process when unset), so they change
across engine restarts, and the disk and remote tiers must find blocks again
after a restart. Our key is a SHA-256 chain over the token ids of each full
block, seeded with a namespace that pins down everything the KV bytes depend
on: model, dtype, KV layout, block size, TP rank and world size, and our
format version. Two engines agree on a key only if their KV bytes for that
prefix would be the same.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

# Bump when the stored page format changes, so old pages never match.
FORMAT_VERSION = 1

BlockKey = bytes  # 32 bytes


@dataclass(frozen=True)
class KeyNamespace:
    model: str
    dtype: str
    kv_layout: str
    block_size: int
    block_bytes: int
    tp_rank: int
    tp_size: int
    extra: str = ""

    def seed(self) -> bytes:
        text = "|".join([
            f"kvbm-v{FORMAT_VERSION}", self.model, self.dtype, self.kv_layout,
            str(self.block_size), str(self.block_bytes), str(self.tp_rank),
            str(self.tp_size), self.extra,
        ])
        return hashlib.sha256(text.encode()).digest()


def request_salt(lora_name: str | None, cache_salt: str | None) -> bytes:
    """Per-request inputs besides tokens that change the KV (LoRA, cache salt)."""
    if not lora_name and not cache_salt:
        return b""
    return hashlib.sha256(f"{lora_name or ''}|{cache_salt or ''}".encode()).digest()


class KeyChain:
    """Incrementally computed keys of a request's full blocks.

    ``extend`` is called as the request's tokens grow; keys for complete
    blocks are computed once and kept.
    """

    def __init__(self, seed: bytes, block_size: int, salt: bytes = b""):
        self._parent = hashlib.sha256(seed + salt).digest()
        self._block_size = block_size
        self.keys: list[BlockKey] = []

    def extend(self, token_ids) -> list[BlockKey]:
        bs = self._block_size
        full = len(token_ids) // bs
        for i in range(len(self.keys), full):
            block = token_ids[i * bs:(i + 1) * bs]
            h = hashlib.sha256(self._parent)
            h.update(struct.pack(f"<{bs}q", *block))
            self._parent = h.digest()
            self.keys.append(self._parent)
        return self.keys
