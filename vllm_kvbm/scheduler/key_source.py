"""Whether block keys can come from vLLM's own block hashes (keys.py).

vLLM's hashes qualify only when they are reproducible across processes and
restarts and collision resistant, and name exactly our blocks:

- ``--prefix-caching-hash-algo`` is ``sha256`` or ``sha256_cbor`` (xxhash is
  not collision resistant, and vLLM seeds its root randomly per process);
- vLLM resolves the root hash (NONE_HASH) from a deterministic seed: the
  fixed default, or PYTHONHASHSEED when set (engines sharing tiers then need
  the same value, or they just miss each other's pages);
- its hashes are 32 bytes, at our block size (``hash_block_size``);
- at the first request, vLLM's request hasher gives a probe request of two
  blocks exactly the hashes expected (block 0 from NONE_HASH, block 1 chained
  on block 0, at our block size): a vLLM that hashes otherwise is caught.

Per request: vLLM's NONE_HASH is still the one expected (another engine in
the same process may have set it since), and the request has one hash per
full block. Anything else, or any doubt (a vLLM without these functions), and
the keys come from our own chain. Decided once here, in the scheduler process.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# vLLM's collision-resistant block hash algorithms (32-byte SHA-256 digests).
_ALGOS = ("sha256", "sha256_cbor")


class VllmBlockHashes:
    """vLLM's block hashes as a key source: ``covers(request)`` says whether
    a request's keys may come from its ``block_hashes``."""

    def __init__(
        self, algo: str, hash_fn: Callable[[Any], bytes], none_hash: bytes, block_size: int, kcu
    ):
        self.algo = algo
        self._hash_fn = hash_fn
        self._none_hash = none_hash
        self._block_size = block_size
        self._kcu = kcu  # vllm.v1.core.kv_cache_utils
        self._verified = False
        self.failed = ""  # why vLLM's hashes were found unusable after startup
        # Non-empty when vLLM's hashes were found to name multimodal items and
        # prompt embeddings too (a line that says so): such requests may be cached.
        self.inputs = ""

    def covers(self, request: "Request") -> bool:
        if self.failed:
            return False
        if len(request.block_hashes) != request.num_tokens // self._block_size:
            return False  # not one hash per full block of ours
        if getattr(self._kcu, "NONE_HASH", None) != self._none_hash:
            return False  # rooted elsewhere (re-initialized since)
        return self._verified or self._verify()

    def _verify(self) -> bool:
        """Once, at the first request (vLLM sets NONE_HASH after creating the
        connector): vLLM's request hasher, run on a probe request of two
        blocks, gives exactly the hashes expected of vLLM 0.32's hashing:
        hash_fn((parent, token ids, None)), block 0's parent NONE_HASH, block
        1's block 0's hash, at our block size. Any other hashing (a vLLM that
        hashes otherwise) turns vLLM's hashes off: keys from our chain."""
        kcu, bs, hash_fn = self._kcu, self._block_size, self._hash_fn
        try:
            from vllm import SamplingParams
            from vllm.v1.request import Request

            tokens = list(range(1, 2 * bs + 2))  # two full blocks and a token
            probe = Request(
                "kvbm-key-source-probe",
                tokens,
                SamplingParams(max_tokens=1),
                None,
                block_hasher=kcu.get_request_block_hasher(bs, hash_fn),
            )
            h0 = hash_fn((self._none_hash, tuple(tokens[:bs]), None))
            h1 = hash_fn((h0, tuple(tokens[bs : 2 * bs]), None))
            if list(probe.block_hashes) != [h0, h1]:
                raise ValueError("a probe request's block hashes are not the ones expected")
            self.inputs = _covers_inputs(
                Request, SamplingParams, kcu.get_request_block_hasher(bs, hash_fn), tokens, [h0, h1]
            )
            if self.inputs:
                logger.info("KVBM: %s", self.inputs)
        except Exception as err:  # noqa: BLE001 - any doubt: our own chain
            self.failed = f"{type(err).__name__}: {err}"
            logger.warning(
                "KVBM: vLLM's block hashes are not as checked (%s): block keys "
                "come from KVBM's own SHA-256 chain",
                self.failed,
            )
            return False
        self._verified = True
        return True


def _covers_inputs(Request, SamplingParams, hasher, tokens: list[int], text: list) -> str:
    """Whether vLLM's request hasher names what besides token ids a request's
    KV depends on, found on probes with the text probe's tokens: a multimodal
    item (its identifier, the content hash vLLM's processor gives it) changes
    the hash of the block it is in and, chained, of every later block; so do
    prompt embeddings; equal inputs hash equal. "" (such requests are not
    cached) if not, or on any doubt."""
    try:
        import torch
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

        def hashes(i: int, **inputs) -> list:
            probe = Request(
                f"kvbm-key-source-probe-{i}",
                tokens,
                SamplingParams(max_tokens=1),
                None,
                block_hasher=hasher,
                **inputs,
            )
            return list(probe.block_hashes)

        def item(name: str) -> list:
            return [
                MultiModalFeatureSpec(
                    data=None,
                    modality="image",
                    identifier=name,
                    mm_position=PlaceholderRange(offset=2, length=4),
                )
            ]

        a, b, a2 = (
            hashes(1, mm_features=item("a")),
            hashes(2, mm_features=item("b")),
            hashes(3, mm_features=item("a")),
        )
        gen = torch.Generator().manual_seed(0)
        e = torch.randn(len(tokens), 8, generator=gen)
        f = e.clone()
        f[1, 0] += 1.0
        ea, eb, ea2 = (
            hashes(4, prompt_embeds=e),
            hashes(5, prompt_embeds=f),
            hashes(6, prompt_embeds=e.clone()),
        )
    except Exception as err:  # noqa: BLE001 - any doubt: such requests are not cached
        logger.info(
            "KVBM: requests with images or prompt embeddings are not cached: this "
            "vLLM's block hashes could not be checked for them (%s: %s)",
            type(err).__name__,
            err,
        )
        return ""
    for x, y, same in ((a, b, a2), (ea, eb, ea2)):
        if len(x) != 2 or x != same or any(x[i] == y[i] or x[i] == text[i] for i in range(2)):
            logger.info(
                "KVBM: requests with images or prompt embeddings are not cached: "
                "this vLLM's block hashes do not name them as checked"
            )
            return ""
    return (
        "requests with images, audio or prompt embeddings are cached: vLLM's block hashes "
        "name each item's content hash and the embeddings"
    )


def vllm_block_hashes(
    vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", block_size: int
) -> tuple[VllmBlockHashes | None, str]:
    """vLLM's block hashes as a key source, or None; and a line that says
    which source the keys come from, and why."""
    algo = getattr(vllm_config.cache_config, "prefix_caching_hash_algo", None)
    chain = "block keys from KVBM's own SHA-256 chain"
    if algo not in _ALGOS:
        return None, (
            f"{chain}: vLLM's --prefix-caching-hash-algo {algo} is not collision "
            f"resistant and its hashes are seeded per process (sha256 and "
            f"sha256_cbor give keys from vLLM's hashes)"
        )
    try:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils as kcu

        hash_fn = get_hash_fn_by_name(algo)
        seed = kcu.resolve_none_hash_seed(hash_fn)
        # A seed drawn at random would differ on a second call.
        deterministic = seed == kcu.resolve_none_hash_seed(hash_fn)
        none_hash = hash_fn(seed)
        _, hash_block_size = kcu.resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
        kcu.get_request_block_hasher  # noqa: B018 - the probe's (VllmBlockHashes._verify)
    except Exception as err:  # noqa: BLE001 - a vLLM without these: our own chain
        return None, f"{chain}: this vLLM's block hashing is not the one checked ({err})"
    if not deterministic:
        return None, f"{chain}: vLLM seeds its {algo} block hashes at random"
    if not isinstance(none_hash, bytes) or len(none_hash) != 32:
        return None, f"{chain}: vLLM's {algo} hashes are not 32 bytes"
    if hash_block_size != block_size:
        return None, (
            f"{chain}: vLLM hashes blocks of {hash_block_size} tokens, KVBM's are {block_size}"
        )
    root = "PYTHONHASHSEED" if os.getenv("PYTHONHASHSEED") is not None else "vLLM's fixed seed"
    return (
        VllmBlockHashes(algo, hash_fn, none_hash, block_size, kcu),
        f"block keys from vLLM's {algo} block hashes (root hash from {root})",
    )
