"""Real vLLM engines for the e2e tests: the local model, one way to start an
engine, prompts and the counters tests read deltas of."""

from __future__ import annotations

import os
import random
from pathlib import Path

from helpers import ROOT
from vllm_kvbm.tools.server import free_port

MODEL_DIR = Path(os.environ.get("KVBM_TEST_MODEL", ROOT / "models" / "kvbm-llama-8l"))
BLOCK_SIZE = 128
# Enough host slots for the correctness tests (the longest prompt is 32
# blocks); the capacity test overfills it.
HOST_BLOCKS = 48
# The kvbm engine also serves its metrics on a standalone port.
KVBM_METRICS_PORT = free_port()
# For engines whose tests count every page loaded from disk or a server: the
# load/recompute split (on by default) may recompute some on a loaded machine
# (test_load_split_e2e tests it).
EVERY_PAGE_LOADED = dict(load_split=False)


def make_llm(kv_transfer_config: dict | None = None, **overrides):
    from vllm import LLM

    args = dict(
        model=str(MODEL_DIR),
        # float32: in bfloat16, vLLM's own prefix-cache hits already change
        # near-tie greedy tokens against a full recompute (the attention over
        # cached KV rounds differently), which would hide what is under test.
        dtype="float32",
        max_model_len=8192,
        max_num_batched_tokens=8192,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=True,
        # Eager on both engines: the compiled and eager paths round differently,
        # and the comparison must differ only in where the KV came from.
        enforce_eager=True,
        gpu_memory_utilization=0.25,
        kv_cache_memory_bytes=1 << 30,
        seed=0,
        disable_log_stats=False,
        kv_transfer_config=kv_transfer_config,
    )
    args.update(overrides)
    return LLM(**args)


def shutdown(llm) -> None:
    """Stops an engine whose processes may have exited already: vLLM's
    shutdown then reads a pid that is gone (psutil.NoSuchProcess), seen with
    TP=2 engines on a loaded machine."""
    import psutil

    try:
        llm.llm_engine.engine_core.shutdown()
    except psutil.NoSuchProcess:
        pass


# A request's kv_transfer_params that neither load nor store: its output is the
# engine's own recompute, the reference for a hit of the same prompt.
RECOMPUTE = {"max_load_tokens": 0, "lmcache.skip_save": True}


def generate_request(llm, prompt: dict, params: dict | None = None, max_tokens: int = 16):
    """One greedy request (a prompt dict: token ids, embeddings, multimodal data)
    sent with kv_transfer_params ``params``; its RequestOutput."""
    from vllm import SamplingParams

    sp = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        extra_args={"kv_transfer_params": params} if params else None,
    )
    return llm.generate([prompt], sp, use_tqdm=False)[0]


def random_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 7000) for _ in range(n)]


def kvbm_counter(name: str) -> float:
    """Sum over engines of the counter the connector counts as ``name``
    (its internal key: ``"offload_blocks_d2h"``, ``"matched_tokens_disk"``),
    read from the series it is exported as in this process's registry."""
    from prometheus_client import REGISTRY

    from vllm_kvbm.metric_names import FAMILIES, series_of

    family, labels = series_of(name)
    sample_name = FAMILIES[family].sample
    total = 0.0
    for metric in REGISTRY.collect():
        for sample in metric.samples:
            if sample.name == sample_name and labels.items() <= sample.labels.items():
                total += sample.value
    return total


def vllm_counter(name: str) -> float:
    from prometheus_client import REGISTRY

    return sum(s.value for m in REGISTRY.collect() for s in m.samples if s.name == f"{name}_total")


def spare_core() -> bool:
    """Whether the engines are bound to one core of several (scripts/test.sh's
    workers): a core is then free for layer-wise copies and reads."""
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    return bind.isdigit() and len(os.sched_getaffinity(0)) > 1
