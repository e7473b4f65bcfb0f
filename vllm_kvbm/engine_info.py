"""Facts about the engine that both connector sides derive identically.

The scheduler and the worker run in different processes; each computes the
block size, the bytes of one block and the key namespace from the same
vLLM config, so they agree on slot counts and keys without a handshake.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_kvbm.config import KVBMConfigError
from vllm_kvbm.identity import key_namespace
from vllm_kvbm.keys import KeyNamespace

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


# Block outermost, then layers: a block's layers are one run of bytes, so a
# block is one copy and consecutive blocks one copy (copy_runs.py). Under
# vLLM's default (layer outermost) a 70B page is 1,280 copies of 8-64 KiB.
# Head-major interior, as vLLM's own offloading and NIXL connectors ask
# (LBHNC): the one block-outer layout FlashInfer's Blackwell kernels take too.
BLOCK_MAJOR_LAYOUT = "BLHNC"
# vLLM refuses a block-outer layout when it splits a block into smaller
# kernel blocks (create_kv_cache_views); no NVIDIA attention backend needs
# that at 64 tokens or fewer (FlashInfer's largest kernel block is 64).
MAX_BLOCK_MAJOR_TOKENS = 64


def requested_kv_cache_layout(vllm_config) -> str | None:
    """The KV cache layout KVBM asks vLLM for, or None (vLLM's own choice).

    Asked only where the copy engines move the blocks (NVIDIA CUDA) and vLLM
    can lay blocks out that way; a backend that refuses it makes vLLM keep
    its own choice (with a warning), and an explicit VLLM_KV_CACHE_LAYOUT
    wins outright (beside another connector that asks for a layout of its
    own, that is how to settle the disagreement). Safe for stored pages: the
    resolved layout is in every page's namespace (identity.py) and the
    per-layer strides in its header (tier_io.layout_fingerprint).
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return None  # CPU, ROCm: their backends take no block-outer layout
    block_size = getattr(vllm_config.cache_config, "block_size", None)
    if block_size is not None and block_size > MAX_BLOCK_MAJOR_TOKENS:
        return None
    return BLOCK_MAJOR_LAYOUT


@dataclass(frozen=True)
class GroupInfo:
    """One KV cache group of a hybrid model, as KVBM pages it
    (scheduler/group_pages.py): "full" (every page of the prefix), "window"
    (a sliding window: the ``window`` tokens before a hit's end), "chunk"
    (chunked-local attention: the hit's end's chunk of ``window`` tokens) or
    "state" (Mamba / Gated DeltaNet state in vLLM's align mode: the block at a
    hit's end)."""

    index: int
    kind: str
    window: int = 0  # a "window" group's window, a "chunk" group's chunk (tokens)


@dataclass(frozen=True)
class EngineInfo:
    block_size: int
    # Bytes of one block on one worker: every layer's K and V pages.
    block_bytes: int
    num_layers: int
    num_workers: int
    key_namespace: KeyNamespace
    # Blocks per page: the unit the tiers store and the scheduler keys
    # (config page_tokens / block_size).
    page_blocks: int = 1
    # This engine's data-parallel rank (0 without DP): replicas compute the
    # same KV (same keys), but each disk index is its own (tiers/disk/view.py).
    data_parallel_index: int = 0
    # The KV cache groups of a hybrid model (empty: one group, paged as a
    # whole), and the one whose pages carry the prefix's keys (its first
    # full-attention group).
    groups: tuple[GroupInfo, ...] = ()
    primary: int = 0

    @property
    def hybrid(self) -> bool:
        return bool(self.groups)

    @property
    def page_tokens(self) -> int:
        return self.block_size * self.page_blocks

    @property
    def page_bytes(self) -> int:
        return self.block_bytes * self.page_blocks

    @property
    def tier_namespace(self) -> str:
        """What the disk and remote tiers file this engine's pages under."""
        return self.key_namespace.seed().hex()


def engine_info(
    vllm_config: "VllmConfig",
    kv_cache_config: "KVCacheConfig",
    namespace: str = "",
    page_tokens: int | None = None,
) -> EngineInfo:
    groups = kv_cache_config.kv_cache_groups
    _refuse_unproven_specs(vllm_config, groups)
    spec = groups[0].kv_cache_spec
    if not vllm_config.cache_config.enable_prefix_caching:
        raise KVBMConfigError(
            "enable_prefix_caching: KVBMConnector needs vLLM's prefix caching "
            "(it stores and finds blocks by prefix); remove --no-enable-prefix-caching"
        )
    parallel = vllm_config.parallel_config
    _refuse_unsupported_parallelism(parallel)
    # A hybrid model's groups share one pool of blocks: block b of any group
    # is the same bytes of the same tensors (one layer of each group per
    # tensor), so a block is its largest group's layers.
    num_layers = max(len(g.layer_names) for g in groups)
    page_blocks = _page_blocks(page_tokens, spec.block_size)
    namespace_key = key_namespace(vllm_config, kv_cache_config, page_blocks, namespace)
    hybrid = hybrid_groups(groups)
    return EngineInfo(
        block_size=spec.block_size,
        block_bytes=spec.page_size_bytes * num_layers,
        num_layers=num_layers,
        num_workers=parallel.world_size,
        key_namespace=namespace_key,
        page_blocks=page_blocks,
        data_parallel_index=_data_parallel_index(parallel),
        groups=hybrid or (),
        primary=next((g.index for g in hybrid if g.kind == "full"), 0) if hybrid else 0,
    )


def _group_kind(spec) -> GroupInfo | None:
    """How KVBM pages a group of this spec (index 0), or None: not served.
    By exact type: subclasses hold other data in their blocks."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    kind = type(spec)
    if kind in (FullAttentionSpec, MLAAttentionSpec):
        return GroupInfo(0, "full")
    if kind is SlidingWindowSpec:
        # vLLM keeps the blocks of the tokens from num_computed - window + 1
        # (minus the ones retained for MTP) on: a hit at a boundary reads them.
        return GroupInfo(0, "window", spec.sliding_window - 1 + spec.extra_retained_tokens)
    if kind is ChunkedLocalAttentionSpec:
        # a token attends to its own chunk of this many tokens (Llama 4)
        return GroupInfo(0, "chunk", spec.attention_chunk_size)
    if kind is MambaSpec and getattr(spec, "mamba_cache_mode", None) == "align":
        # align mode keeps the state at block boundaries, in the block that ends there
        return GroupInfo(0, "state")
    return None


def hybrid_groups(groups) -> tuple[GroupInfo, ...] | None:
    """The groups of a hybrid model KVBM serves (several groups, at least
    one full attention, every one of a kind it pages, one page size); ()
    for a model of one group; None when KVBM does not serve it."""
    if len(groups) == 1:
        return ()
    kinds = []
    for i, g in enumerate(groups):
        kind = _group_kind(_scheduler_spec(g.kv_cache_spec))
        if kind is None:
            return None
        kinds.append(GroupInfo(i, kind.kind, kind.window))
    if not any(k.kind == "full" for k in kinds):
        return None
    if len({_scheduler_spec(g.kv_cache_spec).page_size_bytes for g in groups}) != 1:
        return None
    if len({_scheduler_spec(g.kv_cache_spec).block_size for g in groups}) != 1:
        return None
    return tuple(kinds)


def _proven_spec_types() -> tuple[type, ...]:
    """The KV cache specs whose blocks hold each token's plain K and V (or MLA
    latent), a function of the prefix alone: what pages store, keys name and
    loads restore. Matched by exact type: vLLM's subclasses of
    FullAttentionSpec (attention sinks, R-SWA, hidden-state caches) hold
    other things in their blocks. A sliding-window or chunked-local layer
    reaches here as a plain FullAttentionSpec (window recorded) when vLLM's
    hybrid allocator is off, and its full KV is stored."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    return FullAttentionSpec, MLAAttentionSpec


# Group kinds whose layers run as plain full attention, their whole KV
# stored, when vLLM's hybrid allocator is off.
_WINDOWED_SPECS = ("SlidingWindowSpec", "SlidingWindowMLASpec", "ChunkedLocalAttentionSpec")


def _scheduler_spec(spec):
    """A group's spec as vLLM hands it to the scheduler: a
    UniformTypeKVCacheSpecs group (layers of one type, different shapes) as
    its first layer's spec (generate_scheduler_kv_cache_config)."""
    per_layer = getattr(spec, "kv_cache_specs", None)
    return next(iter(per_layer.values())) if per_layer else spec


def kept_out_reason(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> str | None:
    """Why KVBM looks nothing up and stores nothing for this model, or None
    when it serves it: one KV cache group of a proven spec type.

    Hybrid models (Mamba/GDN state, sliding-window or chunked-local groups
    beside full attention), several groups and unproven spec types are kept
    out: their blocks are not one prefix's plain KV, and a miss is safe where
    wrong KV is not. Decided from the groups as the scheduler sees them, so
    the scheduler and every worker decide alike; a worker whose group turns
    out unproven per layer is refused by engine_info instead."""
    groups = kv_cache_config.kv_cache_groups
    kinds = [type(_scheduler_spec(g.kv_cache_spec)) for g in groups]
    if len(kinds) == 1 and kinds[0] in _proven_spec_types():
        return None
    model = getattr(vllm_config.model_config, "model", None)
    if hybrid_groups(groups):
        return _states_moved_reason(vllm_config, groups, model)
    windowed = any(kind.__name__ in _WINDOWED_SPECS for kind in kinds)
    return (
        f"KVBM: model {model!r} has KV cache groups KVBM does not serve yet "
        f"({_count_groups(groups)}): KVBM looks up and stores nothing for it, so no "
        f"prefix hits come from KVBM (vLLM's own prefix caching still works). KVBM "
        f"stores and loads one KV cache group of "
        f"{' or '.join(t.__name__ for t in _proven_spec_types())}, or {_HYBRID_SERVED}."
        + (
            " With --disable-hybrid-kv-cache-manager vLLM runs the sliding-window "
            "layers as full attention, and KVBM stores their whole KV."
            if windowed
            else ""
        )
    )


def vllm_hands_off_states() -> bool:
    """Whether vLLM's scheduler names the block that holds each Mamba
    "align" state it keeps, with its exact boundary
    (``SchedulerOutput.kv_connector_block_state.boundary_state_offloads``,
    vLLM 0.32): KVBM stores those blocks (scheduler/group_pages.py). Without
    it, the state at a boundary is read from the block at its position."""
    from vllm.v1.core.sched.output import SchedulerOutput

    return "kv_connector_block_state" in getattr(SchedulerOutput, "__dataclass_fields__", {})


def _states_moved_reason(vllm_config: "VllmConfig", groups, model) -> str | None:
    """Why a hybrid's Mamba state cannot be stored, or None. Without vLLM's
    hand-offs a state is read from the block at its boundary's position, and
    vLLM 0.32 keeps one elsewhere when speculative decoding (MTP, EAGLE)
    gives a state group speculative blocks, which it relocates in the table,
    or moves its prefill checkpoints a block back (EAGLE's block drop), and
    when ``prefix_match_unit`` is below a state group's block size (states
    at boundaries inside a block, checkpoints in the column before the
    chunk's last, copies on write)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    specs = [_scheduler_spec(g.kv_cache_spec) for g in groups]
    states = [s for s in specs if type(s) is MambaSpec]
    if not states or vllm_hands_off_states():
        return None
    unit = getattr(vllm_config.cache_config, "prefix_match_unit", None)
    spec_tokens = getattr(vllm_config, "num_speculative_tokens", 0) or 0
    if spec_tokens or any(s.num_speculative_blocks for s in states):
        setting = (
            f"speculative decoding (--speculative-config, {spec_tokens or 'some'} "
            f"speculative tokens)",
            "remove --speculative-config",
        )
    elif unit is not None and any(unit < s.block_size for s in states):
        setting = (
            f"--prefix-match-unit {unit} (below the Mamba block size, "
            f"{min(s.block_size for s in states)} tokens)",
            "unset --prefix-match-unit",
        )
    else:
        return None
    return (
        f"KVBM: model {model!r}: with {setting[0]} vLLM keeps a Mamba state in another "
        f"block than its boundary's, and this vLLM does not hand connectors the block of "
        f"each boundary (SchedulerOutput.kv_connector_block_state): KVBM looks up and "
        f"stores nothing for this model, so no prefix hits come from KVBM (vLLM's own "
        f"prefix caching still works). To serve it, {setting[1]}, or run a vLLM whose "
        f"scheduler hands them off (vLLM 0.32's does)."
    )


_HYBRID_SERVED = (
    "groups of FullAttentionSpec beside groups of SlidingWindowSpec, "
    "ChunkedLocalAttentionSpec or MambaSpec in align mode, one spec per group, "
    "of one page size"
)


def refuse_unproven_layers(specs: dict, layer_names) -> None:
    """Worker side, before anything is copied: each registered layer whose
    spec vLLM declares (``specs``: layer -> its own spec) is of a proven type
    exactly, so no layer's blocks are ever copied as plain KV that are not."""
    proven = _proven_spec_types()
    wrong = [
        f"{name}: {type(specs[name]).__name__}"
        for name in layer_names
        if name in specs and _group_kind(specs[name]) is None
    ]
    if wrong:
        raise KVBMConfigError(
            f"KVBMConnector does not support these KV cache layers: {_layer_list(wrong)}. "
            f"It copies layers of {' or '.join(t.__name__ for t in proven)}, "
            f"SlidingWindowSpec, ChunkedLocalAttentionSpec or MambaSpec (align mode) exactly. Run "
            f"this model without KVBMConnector (remove --kv-transfer-config)."
        )


def _count_groups(groups) -> str:
    """'MambaSpec: 3 groups, 36 layers; FullAttentionSpec: 1 group, 12 layers'."""
    counts: dict[str, list[int]] = {}
    for g in groups:
        count = counts.setdefault(type(_scheduler_spec(g.kv_cache_spec)).__name__, [0, 0])
        count[0] += 1
        count[1] += len(g.layer_names)
    return (
        "; ".join(
            f"{name}: {n} group{'s' * (n != 1)}, {layers} layers"
            for name, (n, layers) in counts.items()
        )
        or "no KV cache groups"
    )


def _refuse_unproven_specs(vllm_config: "VllmConfig", groups) -> None:
    """One KV cache group, of a proven spec type; else a startup error naming
    the model, each group's spec type and layers, and the way out."""
    proven = _proven_spec_types()
    if len(groups) == 1 and type(groups[0].kv_cache_spec) in proven:
        return
    if (
        len(groups) > 1
        and hybrid_groups(groups)
        and not any(getattr(g.kv_cache_spec, "kv_cache_specs", None) for g in groups)
    ):
        return  # each group of one spec (a worker's may hold several: refused)
    model = getattr(vllm_config.model_config, "model", None)
    described = (
        "; ".join(
            f"group {i}: {type(g.kv_cache_spec).__name__} (layers {_layer_list(g.layer_names)})"
            for i, g in enumerate(groups)
        )
        or "no KV cache groups"
    )
    raise KVBMConfigError(
        f"KVBMConnector does not support the KV cache of model {model!r}: {described}. "
        f"It stores and loads one KV cache group of "
        f"{' or '.join(t.__name__ for t in proven)} exactly (not subclasses of them, whose "
        f"blocks hold other data), or {_HYBRID_SERVED}. Run this model without KVBMConnector "
        f"(remove --kv-transfer-config)."
    )


def _layer_list(names: list[str], shown: int = 3) -> str:
    more = f", ... {len(names)} in all" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _data_parallel_index(parallel) -> int:
    """The DP rank: vLLM sets a dense model's DP ranks to rank 0 of 1 (they
    are independent engines) and keeps the rank in data_parallel_index."""
    index = getattr(parallel, "data_parallel_index", None)
    return int(parallel.data_parallel_rank if index is None else index)


# Default page when vLLM's blocks are small (GPUs' 16 tokens): the
# scheduler keeps books per page, and at 256 tokens a page (LMCache's chunk)
# its work per step stays a few percent of vLLM's (docs/benchmarks.md).
# Blocks of 128 tokens and more (vLLM CPU's default) are a page each.
AUTO_PAGE_TOKENS = 256
_AUTO_MIN_BLOCK = 128


def _page_blocks(page_tokens: int | None, block_size: int) -> int:
    """Blocks per page; a page must be whole blocks."""
    if page_tokens is None:
        return 1 if block_size >= _AUTO_MIN_BLOCK else -(-AUTO_PAGE_TOKENS // block_size)
    if page_tokens % block_size:
        raise KVBMConfigError(
            f"page_tokens: {page_tokens} is not a multiple of vLLM's block size "
            f"({block_size} tokens, --block-size); set page_tokens to a multiple of it, "
            f"e.g. {max(1, round(page_tokens / block_size)) * block_size}"
        )
    return page_tokens // block_size


def _refuse_unsupported_parallelism(parallel) -> None:
    """Pipeline and context parallelism shard a block's KV in ways the page
    format does not describe (layers per stage, tokens per rank): refuse them
    at startup rather than store pages another layout would misread."""
    for field, what in (
        ("pipeline_parallel_size", "pipeline parallelism"),
        ("decode_context_parallel_size", "decode context parallelism"),
        ("prefill_context_parallel_size", "prefill context parallelism"),
    ):
        size = getattr(parallel, field, 1) or 1
        if size > 1:
            flag = "--" + field.replace("_", "-")
            raise KVBMConfigError(
                f"{field}={size}: KVBMConnector does not support {what} yet (each rank "
                f"holds a different part of a block's KV); run with {flag} 1, or remove "
                f"--kv-transfer-config. Tensor parallelism is supported."
            )
