"""Page keys: what a stored page of KV is called in every tier.

A key names a page's KV: its full token prefix plus everything else the KV
bytes depend on. The namespace (``KeyNamespace.seed``, derived in one place:
identity.py) covers the model and its weights, vLLM's KV cache spec and
every vLLM setting not reviewed as harmless, the page geometry and the
tensor-parallel size; per request, ``request_salt`` adds the LoRA adapter
(name, id, path and a hash of its files) and the cache salt. Two engines
agree on a key only if their KV bytes for that prefix would be the same.
Every field is encoded as JSON, so no value can be confused with another's
boundary. Keys are the same across processes and restarts: the disk and
remote tiers find pages again after a restart and across engines.

Keys come from one of two sources, chosen in the scheduler process
(``scheduler/key_source.py``):

- ``VllmHashKeys``: vLLM's own block hashes (``request.block_hashes``, which
  vLLM computes when a request arrives, outside ``schedule()``), when they are
  reproducible and collision resistant: a SHA-256 algorithm (vLLM >= 0.32
  then derives its root hash, NONE_HASH, from a fixed seed or PYTHONHASHSEED,
  not from random bytes), 32-byte hashes at vLLM's block size, chained over
  the whole prefix. Page ``i``'s key is the hash of its last block XOR ``D``
  (with one-block pages, ``block_hashes[i] XOR D``), ``D`` being a SHA-256
  of the namespace seed, the request salt, the vLLM hash algorithm and a tag
  of its own. XOR with a constant is a bijection, so two prefixes share a key
  within a namespace only if vLLM's SHA-256 hashes collide; across
  namespaces (or against a ``KeyChain`` key) a clash needs two SHA-256
  outputs with a given XOR difference, as hard as a collision. vLLM's hash
  covers the tokens, the LoRA name and path, the cache salt, each block's
  multimodal items (their content hashes) and its prompt embeddings (a
  SHA-256 of their values): requests with those are cached only under these
  keys, once probes showed vLLM's hashes name them (key_source.py);
  ``D`` adds everything ours covers on top, so a key never names less than
  the chain's would. XORing is one numpy operation over the joined hashes,
  where a chain computes a SHA-256 per page: the scheduler's keys cost least.
- ``KeyChain``: our own SHA-256 chain over the token ids of each full page,
  seeded with the namespace seed and the salt. Used whenever vLLM's hashes do
  not qualify (``--prefix-caching-hash-algo xxhash``, whose root is random per
  process unless PYTHONHASHSEED is set; a vLLM whose hashing differs from
  what is checked), and per request when its hashes do not cover exactly its
  full blocks.

The two kinds of key never name each other's pages (different derivations;
a clash is a SHA-256 collision), so switching source costs misses, never
wrong KV. Weights other than those loaded (digested by the workers after a
prefix-cache reset, scheduler/weights_epochs.py) move the seed: both kinds change.
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
from dataclasses import astuple, dataclass

import numpy as np

# Bump when the key derivation changes, so pages stored under the old one
# are never looked up again.
FORMAT_VERSION = 3

PageKey = bytes  # 32 bytes: a page's name (docs/how-it-works.md, "Words")

# Tag of the keys derived from vLLM's block hashes (VllmHashKeys): part of D,
# so they are apart from every other derivation's.
VLLM_HASH_KEYS_TAG = f"kvbm-v{FORMAT_VERSION}-vllm-block-hash-keys"
# Below this many keys, XORing each hash as a Python int beats numpy's
# fixed cost (the two cost the same at about 12 keys).
_NUMPY_XOR_MIN = 12


def _digest(*fields) -> bytes:
    return hashlib.sha256(json.dumps(list(fields)).encode()).digest()


# Tag of a hybrid model's group pages (group_key): part of the hash input, so
# a group's key is never another derivation's.
GROUP_KEY_TAG = f"kvbm-v{FORMAT_VERSION}-group".encode()


def group_key(key: PageKey, group: int) -> PageKey:
    """The key of KV cache group ``group``'s page of the page keyed ``key``
    (scheduler/group_pages.py): a SHA-256 of the two, so one group's page is
    never read as another's, nor as the page ``key`` names."""
    return hashlib.sha256(GROUP_KEY_TAG + struct.pack("<I", group) + key).digest()


def derive_seed(seed: bytes, *fields: str) -> bytes:
    """A new key seed from an old one (e.g. for the weights the workers run)."""
    return _digest(seed.hex(), *fields)


@dataclass(frozen=True)
class KeyNamespace:
    """Everything besides a page's tokens that its KV bytes depend on, as
    derived once by ``identity.key_namespace``; its ``seed`` starts every key."""

    model: str  # model id @ revision
    dtype: str  # the KV cache's torch dtype
    kv_layout: str
    block_size: int  # tokens of one vLLM block
    page_bytes: int  # bytes of one page on one worker, every layer's K and V
    tp_size: int
    extra: str = ""  # the operator's namespace (config "namespace")
    page_blocks: int = 1  # vLLM blocks per page
    # vLLM's --kv-cache-dtype ("auto", "fp8_e4m3", ...) and the layers it
    # skips: fp8 formats all have the torch dtype uint8.
    kv_cache_dtype: str = "auto"
    quantization: str = ""  # of the weights ("" when none)
    # A hash of every byte of the model's config and weight files
    # (fingerprints.py): new weights at the same path give new keys.
    model_fingerprint: str = ""
    kv_spec: str = ""  # vLLM's KV cache groups and specs (identity.kv_spec_identity)
    config: str = ""  # digest of every vLLM setting not reviewed as harmless

    @property
    def page_tokens(self) -> int:
        return self.block_size * self.page_blocks

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


class _PageKeys:
    """A request's page keys, computed on demand (``extend_to``) and kept in
    ``keys``, which only ever grows."""

    _page_tokens: int
    keys: list[PageKey]
    # Whether a key costs next to nothing: a lookup then derives every key
    # it may need in one call (an XOR of vLLM's hashes: the numpy call costs
    # more than its keys), where a SHA-256 chain hashes as the hit grows.
    cheap = False

    def extend(self, token_ids) -> list[PageKey]:
        """Keys of every full page of ``token_ids`` (and any computed before)."""
        self.extend_to(token_ids, len(token_ids) // self._page_tokens)
        return self.keys

    def extend_to(self, token_ids, num_pages: int) -> None:
        raise NotImplementedError


class KeyChain(_PageKeys):
    """Incrementally computed keys of a request's full pages.

    Key ``i`` is SHA-256(key ``i-1`` + page ``i``'s token ids as little-endian
    int64), key ``-1`` being SHA-256(seed + salt). Keys are computed on demand
    (``extend_to``: only as far as asked, from the token ids not yet hashed)
    and kept; ``keys`` only ever grows.
    """

    def __init__(self, seed: bytes, page_tokens: int, salt: bytes = b""):
        self._parent = hashlib.sha256(seed + salt).digest()
        self._page_tokens = page_tokens
        self.keys: list[PageKey] = []

    @classmethod
    def continuing(cls, keys: list[PageKey], parent: bytes, page_tokens: int) -> "KeyChain":
        """A chain that appends to ``keys`` (the keys of the pages before),
        key ``len(keys)`` being SHA-256(``parent`` + that page's token ids)."""
        chain = cls.__new__(cls)
        chain._parent, chain._page_tokens, chain.keys = parent, page_tokens, keys
        return chain

    def extend_to(self, token_ids, num_pages: int) -> None:
        """Computes keys up to page ``num_pages`` (exclusive), reading only
        the token ids of the pages not hashed yet; ``token_ids`` needs at
        least ``num_pages`` full pages."""
        done = len(self.keys)
        if num_pages <= done:
            return
        pt = self._page_tokens
        step = 8 * pt  # bytes per page
        # One pack for all new pages; then one hash call per page.
        data = struct.pack(f"<{(num_pages - done) * pt}q", *token_ids[done * pt : num_pages * pt])
        sha256, parent, append = hashlib.sha256, self._parent, self.keys.append
        for off in range(0, len(data), step):
            parent = sha256(parent + data[off : off + step]).digest()
            append(parent)
        self._parent = parent


@functools.lru_cache(maxsize=4096)  # most requests share a seed and salt
def vllm_key_mask(seed: bytes, salt: bytes, algo: str) -> bytes:
    """D: what VllmHashKeys XORs into each of vLLM's block hashes."""
    return _digest(VLLM_HASH_KEYS_TAG, seed.hex(), salt.hex(), algo)


def xor_keys(hashes, start: int, end: int, mask: bytes, stride: int = 1) -> list[PageKey]:
    """``hashes[i*stride + stride-1] XOR mask`` for i in [start, end) (the
    last block of each page of ``stride`` blocks): 32-byte hashes and mask."""
    picked = hashes[start * stride + stride - 1 : end * stride : stride]
    if end - start < _NUMPY_XOR_MIN:
        m, from_bytes = int.from_bytes(mask, "little"), int.from_bytes
        return [(from_bytes(h, "little") ^ m).to_bytes(32, "little") for h in picked]
    data = b"".join(picked)
    if len(data) != 32 * (end - start):
        raise ValueError("block hashes must be 32 bytes each")
    out = np.frombuffer(data, dtype=np.uint64).reshape(-1, 4) ^ np.frombuffer(mask, dtype=np.uint64)
    # A 32-byte void per row: tolist() gives one bytes object each (unlike
    # "S32", which would strip trailing zero bytes).
    return out.view("V32").ravel().tolist()


class VllmHashKeys(_PageKeys):
    """A request's keys from vLLM's block hashes: key ``i`` is
    ``block_hashes[i] XOR vllm_key_mask(seed, salt, algo)``; with pages of
    ``stride`` blocks (``page_tokens`` tokens), page ``i``'s
    key comes from its last block's hash, which covers the whole prefix.

    Same interface as ``KeyChain``. ``block_hashes`` is the request's own
    list, which vLLM extends as tokens arrive. Keys are computed on demand and
    kept. Should vLLM not have hashed a page asked for (the scheduler only
    asks for pages whose tokens exist, which vLLM hashes as they come), the
    keys go on as a ``KeyChain`` from the last key: still one name per
    prefix, never another's.
    """

    cheap = True

    def __init__(
        self,
        seed: bytes,
        page_tokens: int,
        salt: bytes,
        block_hashes: list,
        algo: str,
        stride: int = 1,
    ):
        self._mask = vllm_key_mask(seed, salt, algo)
        self._hashes = block_hashes
        self._page_tokens = page_tokens
        self._stride = stride
        self._rest: KeyChain | None = None
        self.keys: list[PageKey] = []

    def extend_to(self, token_ids, num_pages: int) -> None:
        """Computes keys up to page ``num_pages`` (exclusive); ``token_ids``
        (read only past vLLM's hashes) needs at least ``num_pages`` full pages."""
        done = len(self.keys)
        if num_pages <= done:
            return
        if self._rest is None:
            have = min(num_pages, len(self._hashes) // self._stride)
            if have > done:
                self.keys += xor_keys(self._hashes, done, have, self._mask, self._stride)
            if have >= num_pages:
                return
            parent = (
                self.keys[-1]
                if self.keys
                else hashlib.sha256(b"kvbm-vllm-hash-keys-rest" + self._mask).digest()
            )
            self._rest = KeyChain.continuing(self.keys, parent, self._page_tokens)
        self._rest.extend_to(token_ids, num_pages)
