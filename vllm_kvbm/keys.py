"""Block keys: what a stored KV block is called in every tier.

vLLM's own block hashes are not used as keys: with the default hash they are
seeded from PYTHONHASHSEED (random per process when unset), so they change
across engine restarts, and the disk and remote tiers must find blocks again
after a restart. Our key is a SHA-256 chain over the token ids of each full
block, seeded with a namespace that pins down everything the KV bytes depend
on: the model (name, revision and a fingerprint of its config and weights),
the KV cache dtype (the torch dtype *and* vLLM's ``--kv-cache-dtype``, since
every fp8 format is ``torch.uint8``), the weights' quantization, KV layout,
block size, TP rank and world size, and our format version; per request, the
LoRA adapter (name, id, path and a fingerprint of its files) and the cache
salt. Two engines agree on a key only if their KV bytes for that prefix would
be the same. Every field is encoded as JSON, so no value can be confused with
another's boundary.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import astuple, dataclass

# Bump when the stored page format or the key derivation changes, so old
# pages never match. v2: JSON encoding, KV cache dtype, quantization, model
# fingerprint, LoRA identity.
FORMAT_VERSION = 2

BlockKey = bytes  # 32 bytes


def _digest(*fields) -> bytes:
    return hashlib.sha256(json.dumps(list(fields)).encode()).digest()


def derive_seed(seed: bytes, *fields: str) -> bytes:
    """A new key seed from an old one (e.g. a cache reset's new epoch)."""
    return _digest(seed.hex(), *fields)


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
    # vLLM's --kv-cache-dtype ("auto", "fp8_e4m3", "fp8_e5m2", ...) and the
    # layers it skips: fp8 formats all have the torch dtype uint8.
    kv_cache_dtype: str = "auto"
    # Quantization scheme of the weights ("" when none).
    quantization: str = ""
    # Hash of the model's config and weights (engine_info.files_fingerprint):
    # new weights at the same path give new keys.
    model_fingerprint: str = ""

    def seed(self) -> bytes:
        return _digest(f"kvbm-v{FORMAT_VERSION}", *astuple(self))


@dataclass(frozen=True)
class LoRAIdentity:
    name: str
    int_id: int
    path: str
    # files_fingerprint of the adapter directory ("" when not local)
    fingerprint: str = ""


def request_salt(lora: LoRAIdentity | None, cache_salt: str | None) -> bytes:
    """Per-request inputs besides tokens that change the KV (LoRA, cache salt)."""
    if lora is None and not cache_salt:
        return b""
    return _digest("request", None if lora is None else astuple(lora), cache_salt or "")


class KeyChain:
    """Incrementally computed keys of a request's full blocks.

    Key ``i`` is SHA-256(key ``i-1`` + block ``i``'s token ids as little-endian
    int64), key ``-1`` being SHA-256(seed + salt). Keys are computed on demand
    (``extend_to``: only as far as asked, from the token ids not yet hashed)
    and kept; ``keys`` only ever grows.
    """

    def __init__(self, seed: bytes, block_size: int, salt: bytes = b""):
        self._parent = hashlib.sha256(seed + salt).digest()
        self._block_size = block_size
        self.keys: list[BlockKey] = []

    def extend(self, token_ids) -> list[BlockKey]:
        """Keys of every full block of ``token_ids`` (and any computed before)."""
        self.extend_to(token_ids, len(token_ids) // self._block_size)
        return self.keys

    def extend_to(self, token_ids, num_blocks: int) -> None:
        """Computes keys up to block ``num_blocks`` (exclusive), reading only
        the token ids of the blocks not hashed yet; ``token_ids`` needs at
        least ``num_blocks`` full blocks."""
        done = len(self.keys)
        if num_blocks <= done:
            return
        bs = self._block_size
        step = 8 * bs  # bytes per block
        # One pack for all new blocks; then one hash call per block.
        data = struct.pack(f"<{(num_blocks - done) * bs}q",
                           *token_ids[done * bs:num_blocks * bs])
        sha256, parent, append = hashlib.sha256, self._parent, self.keys.append
        for off in range(0, len(data), step):
            parent = sha256(parent + data[off:off + step]).digest()
            append(parent)
        self._parent = parent
