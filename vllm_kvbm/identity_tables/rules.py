"""The two kinds a vLLM config field is classified as, and the reasons many
fields share (identity_tables/__init__.py says what each kind means)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

IDENTITY = "identity"
HARMLESS = "harmless"


@dataclasses.dataclass(frozen=True)
class Rule:
    kind: str  # IDENTITY or HARMLESS
    reason: str
    # Reduces a value to its meaningful part before it is hashed.
    reduce: Callable[[Any], Any] | None = None


def I(reason: str = "", reduce: Callable[[Any], Any] | None = None) -> Rule:  # noqa: E743
    return Rule(IDENTITY, reason, reduce)


def H(reason: str) -> Rule:
    return Rule(HARMLESS, reason)


# ---- reasons many fields share ------------------------------------------------

RESOLVED = (
    "resolved by the engine core at runtime, unset in a worker's copy; what it "
    "decides about KV is in the KV cache spec (engine_info)"
)
CAPACITY = "how much KV fits, not what it holds"
SCHED = "which requests run together; the same prefix gets the same KV"
PORT = "a network address: differs between replicas"
LOG = "logging or metrics only"
PROFILE = "profiling only"
DP = "data parallel replicas of one model compute the same KV"
PATH = "a file system path: differs between replicas, the content is hashed elsewhere"
STRUCT = "decoding constraints act on sampled tokens, after the KV of the prefix"
RUNTIME = (
    "filled in during model load or compilation in the worker only: the scheduler's copy differs"
)
SPEC_DRAFT = (
    "drafts are verified by the target model, whose KV is the prefix's; draft "
    "layers' KV follows the draft model (identity)"
)
MM_IO = "how multimodal inputs are fetched, cached or shipped, not what they encode to"
SHAPES = (
    "which batch shapes get kernels of their own: one engine already computes a "
    "prefix's KV at any batch shape"
)
GRAPHS = (
    "CUDA graphs replay the kernels a batch would run eagerly, and one engine "
    "already runs a prefix with or without them (batches over the largest "
    "capture size run eager)"
)
AUTOTUNE = (
    "autotuning picks among implementations of one op per machine and shape; "
    "the flag does not say which (the elastic EP path toggles it in workers)"
)
EXPERT_PLACEMENT = (
    "which rank holds which expert: every token reaches the same experts with the same weights"
)
