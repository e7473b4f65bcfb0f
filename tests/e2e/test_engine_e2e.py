"""The central correctness tests, on real vLLM engines with real NIXL.

Every comparison is against a plain engine (no connector) that computed the
whole prompt itself. Between the run that stores a prefix and the run that
must onboard it, the engine's own prefix cache is reset, so the only way the
second run can skip prefill is a load from the host tier.
"""

from __future__ import annotations

import time

import pytest

import urllib.request

import vllm_kvbm
from helpers.engines import BLOCK_SIZE, HOST_BLOCKS, KVBM_METRICS_PORT, kvbm_counter, random_prompt

pytestmark = pytest.mark.timeout(900)


def generate(llm, prompts: list[list[int]], max_tokens: int = 16):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]


def reference(plain_llm, prompts, max_tokens=16):
    plain_llm.reset_prefix_cache()  # the plain engine recomputes everything
    return generate(plain_llm, prompts, max_tokens)[0]


def expected_hit_tokens(n: int) -> int:
    # Full blocks only, and vLLM must compute at least the last token itself.
    return ((n - 1) // BLOCK_SIZE) * BLOCK_SIZE


@pytest.mark.parametrize("length", [50, 128, 256, 1000, 3000])
def test_onboarded_outputs_equal_recomputed(kvbm_llm, plain_llm, length):
    prompt = random_prompt(length, seed=length)
    want = reference(plain_llm, [prompt])

    first, _ = generate(kvbm_llm, [prompt])  # computes and offloads
    kvbm_llm.reset_prefix_cache()
    onboarded_before = kvbm_counter("onboard_blocks_h2d")
    second, cached = generate(kvbm_llm, [prompt])  # must onboard from the host tier

    assert first == want
    assert second == want
    assert cached[0] == expected_hit_tokens(length)
    assert (
        kvbm_counter("onboard_blocks_h2d") - onboarded_before
        == expected_hit_tokens(length) // BLOCK_SIZE
    )


def test_batch_sharing_a_stored_prefix(kvbm_llm, plain_llm):
    prefix = random_prompt(1024, seed=7)
    prompts = [prefix + random_prompt(100 + 37 * i, seed=100 + i) for i in range(4)]
    want = reference(plain_llm, prompts)

    generate(kvbm_llm, [prefix + random_prompt(5, seed=99)])  # stores the prefix
    kvbm_llm.reset_prefix_cache()
    got, cached = generate(kvbm_llm, prompts)

    assert got == want
    # Every request finds at least the shared prefix's 8 blocks.
    assert all(c >= 1024 for c in cached), cached


def test_conversation_growing_turn_by_turn(kvbm_llm, plain_llm):
    """Each turn's prompt is the previous prompt, its answer and a new message.

    Prompt blocks are offloaded as they are prefilled, so turn N onboards
    every full block of turn N-1's prompt (answers of earlier turns included)
    and recomputes the rest; a plain engine recomputes all of it.
    """
    history = random_prompt(600, seed=21)
    previous_prompt_len = 0
    for turn in range(4):
        history = history + random_prompt(150, seed=300 + turn)  # the user's message
        want = reference(plain_llm, [history], max_tokens=24)
        kvbm_llm.reset_prefix_cache()
        got, cached = generate(kvbm_llm, [history], max_tokens=24)
        assert got == want, f"turn {turn}"
        assert cached[0] == previous_prompt_len // BLOCK_SIZE * BLOCK_SIZE, (turn, cached)
        previous_prompt_len = len(history)
        history = history + got[0]


def test_second_request_loads_prefix(kvbm_llm):
    prompt = random_prompt(4000, seed=4000)
    kvbm_llm.reset_prefix_cache()
    t0 = time.perf_counter()
    _, cached_miss = generate(kvbm_llm, [prompt], max_tokens=1)
    miss_s = time.perf_counter() - t0
    kvbm_llm.reset_prefix_cache()
    before = kvbm_counter("matched_tokens")
    t0 = time.perf_counter()
    _, cached_hit = generate(kvbm_llm, [prompt], max_tokens=1)
    hit_s = time.perf_counter() - t0

    print(
        f"TTFT miss {miss_s:.3f}s, host-tier hit {hit_s:.3f}s, "
        f"speedup {miss_s / hit_s:.1f}x (benchmarks/ measure it)"
    )
    assert cached_miss[0] == 0
    assert cached_hit[0] == expected_hit_tokens(4000)
    assert kvbm_counter("matched_tokens") - before == expected_hit_tokens(4000)


def test_filling_host_tier_evicts_lru_and_stays_correct(kvbm_llm, plain_llm):
    # Four prompts of 15 full blocks each: 60 blocks through a 48-block tier.
    prompts = [random_prompt(15 * BLOCK_SIZE + 10, seed=500 + i) for i in range(4)]
    evicted_before = kvbm_counter("host_evictions")
    for p in prompts:
        kvbm_llm.reset_prefix_cache()
        generate(kvbm_llm, [p], max_tokens=2)
    assert kvbm_counter("host_evictions") - evicted_before >= 4 * 15 - HOST_BLOCKS

    want = reference(plain_llm, prompts)
    # Most recent prompt: still fully in the host tier.
    kvbm_llm.reset_prefix_cache()
    got, cached = generate(kvbm_llm, [prompts[-1]])
    assert got == [want[-1]] and cached[0] == 15 * BLOCK_SIZE
    # Oldest prompt: its first blocks were evicted first, so nothing matches.
    kvbm_llm.reset_prefix_cache()
    got, cached = generate(kvbm_llm, [prompts[0]])
    assert got == [want[0]] and cached[0] == 0


def test_standalone_metrics_port_agrees_with_vllm_metrics(kvbm_llm):
    prompt = random_prompt(700, seed=700)
    generate(kvbm_llm, [prompt])
    kvbm_llm.reset_prefix_cache()
    generate(kvbm_llm, [prompt])
    generate(kvbm_llm, [[5] * 20], max_tokens=2)  # one more step flushes the stats

    url = f"http://127.0.0.1:{KVBM_METRICS_PORT}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    values = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line.startswith("kvbm_") and " " in line
    }
    assert values["kvbm_onboard_blocks_total"] >= 5
    assert values["kvbm_onboard_blocks_total"] == kvbm_counter("onboard_blocks_h2d")
    assert values["kvbm_offload_blocks_total"] == kvbm_counter("offload_blocks_d2h")
    assert values["kvbm_onboard_latency_seconds_count"] >= 1
    assert values["kvbm_load_latency_seconds_count"] >= 1
    assert values['kvbm_cache_capacity_blocks{tier="host"}'] == HOST_BLOCKS
    assert 0 < values['kvbm_cache_used_blocks{tier="host"}'] <= HOST_BLOCKS
    assert values[f'kvbm_build_info{{version="{vllm_kvbm.__version__}"}}'] == 1


def test_vllm_counts_host_tier_hits_as_source_host(kvbm_llm):
    """vLLM's own vllm:prompt_tokens_cached_by_source labels KVBM's host-tier
    hits "host" (get_external_cache_hit_sources), not external_unspecified."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    # This engine's own logger: another engine created later in the same
    # process (the plain one) unregisters it from the global REGISTRY.
    (prom,) = [
        lg
        for lg in kvbm_llm.llm_engine.logger_manager.stat_loggers
        if isinstance(lg, PrometheusStatLogger)
    ]

    def by_source() -> dict[str, float]:
        out: dict[str, float] = {}
        for metric in prom.counter_prompt_tokens_cached_by_source.collect():
            for s in metric.samples:
                if s.name == "vllm:prompt_tokens_cached_by_source_total":
                    out[s.labels["source"]] = out.get(s.labels["source"], 0) + s.value
        return out

    prompt = random_prompt(1000, seed=1001)
    generate(kvbm_llm, [prompt], max_tokens=2)
    kvbm_llm.reset_prefix_cache()
    before = by_source()
    _, cached = generate(kvbm_llm, [prompt], max_tokens=2)
    generate(kvbm_llm, [[5] * 20], max_tokens=2)  # one more step flushes the stats
    after = by_source()
    delta = {s: after[s] - before.get(s, 0) for s in after}
    assert cached[0] == expected_hit_tokens(1000)
    assert delta["host"] == expected_hit_tokens(1000)
    assert delta["external_unspecified"] == 0 and delta["disk"] == 0


def _bound_to_one_core_of_several() -> list[int]:
    """The cores left free of the engines' OpenMP threads under scripts/test.sh
    (each worker's engines bound to one core); skips otherwise."""
    import os

    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    cpus = os.sched_getaffinity(0)
    if not bind.isdigit() or len(cpus) < 2:
        pytest.skip("the engine is not bound to one core of several (scripts/test.sh's workers)")
    return sorted(cpus - {int(bind)})


def test_stores_are_copied_on_the_core_vllm_leaves_free(kvbm_llm):
    """scripts/test.sh binds each worker's engines to one core: the other is
    free of vLLM's OpenMP threads, so the session's engine copies its stores
    and host hits layer by layer there (worker/layer_copies.py)."""
    import psutil

    from vllm_kvbm.cpus import threads

    spare = _bound_to_one_core_of_several()
    core = kvbm_llm.llm_engine.engine_core.resources.engine_manager.processes[0].pid
    engine = psutil.Process(core)
    copiers, pinned = [], []
    for name, cpus in threads([p.pid for p in [engine, *engine.children(recursive=True)]]):
        (copiers if name == "kvbm-layer-copy" else pinned).append(sorted(cpus))
    assert copiers == [spare]
    assert spare not in pinned  # no other thread there: no OpenMP thread


@pytest.mark.parametrize("length", [300, 1000, 3000])
def test_host_hits_loaded_layer_by_layer_equal_recomputed(kvbm_llm, plain_llm, length):
    """The synchronous, layer-by-layer load of a host-tier hit, computed in
    the step that loads it: greedy outputs equal a plain engine's."""
    _bound_to_one_core_of_several()
    prompt = random_prompt(length, seed=4242 + length)
    want = reference(plain_llm, [prompt])
    first, _ = generate(kvbm_llm, [prompt])
    kvbm_llm.reset_prefix_cache()
    # A reset starts a weights epoch; until the worker reported its weights
    # in it (the next steps), hits stay asynchronous.
    for i in range(5):
        generate(kvbm_llm, [random_prompt(20, seed=5000 + i)], max_tokens=1)
        time.sleep(0.2)
    layered = kvbm_counter("onboard_layered_blocks")
    second, cached = generate(kvbm_llm, [prompt])
    assert first == want and second == want
    assert cached[0] == expected_hit_tokens(length)
    assert (
        kvbm_counter("onboard_layered_blocks") - layered
        == expected_hit_tokens(length) // BLOCK_SIZE
    )
