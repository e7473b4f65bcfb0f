"""A sliding-window model's bytes stored per cached token and hit TTFT, with
vLLM's hybrid allocator on (KVBM pages each group: the sliding layers keep
only the windows a hit reads, scheduler/group_pages.py) against it off
(``--disable-hybrid-kv-cache-manager``: every layer stored full length).

The Gemma 3-shaped local model (tools/local_model --arch gemma3: five
sliding-window layers with a 256-token window, then a full-attention layer),
float32, one engine per mode in turn on the same cores, the host tier large
enough for every prompt. For each of ``--prompts`` fresh prompts: the miss
(computed and stored), then, vLLM's own prefix cache cleared, the hit from
the host tier; medians and ratios printed from the one run.

    .venv/bin/python benchmarks/bench_hybrid_window.py [--tokens 3968] [--prompts 3]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]


def ttft(llm, prompt: list[int]) -> float:
    from vllm import SamplingParams

    start = time.perf_counter()
    llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(temperature=0.0, max_tokens=1),
        use_tqdm=False,
    )
    return time.perf_counter() - start


def run_mode(model: str, hma: bool, prompts: list[list[int]]) -> dict:
    from helpers.engines import kvbm_counter, make_llm, shutdown
    from vllm_kvbm.tools.server import kvbm_transfer_config

    llm = make_llm(
        kvbm_transfer_config(host_cache_size="2GiB", load_split=False),
        model=model,
        max_model_len=4096,
        max_num_batched_tokens=4096,
        disable_hybrid_kv_cache_manager=not hma,
    )
    try:
        ttft(llm, [7] * 300)  # warm-up, not stored (another prompt)
        misses, hits, stored, matched = [], [], [], []
        for prompt in prompts:
            before = kvbm_counter("offload_bytes_d2h")
            misses.append(ttft(llm, prompt))
            time.sleep(1.0)
            ttft(llm, [7] * 8)  # a step collects the stores' completions
            stored.append(kvbm_counter("offload_bytes_d2h") - before)
            assert llm.reset_prefix_cache()
            before = kvbm_counter("matched_tokens_host")
            hits.append(ttft(llm, prompt))
            matched.append(kvbm_counter("matched_tokens_host") - before)
        tokens = len(prompts[0]) // 128 * 128  # the full pages stored
        return {
            "miss_s": statistics.median(misses),
            "hit_s": statistics.median(hits),
            "bytes_per_token": statistics.median(stored) / tokens,
            "hit_tokens": statistics.median(matched),
        }
    finally:
        shutdown(llm)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=3968)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--model", help="default: the local Gemma 3-shaped model (built if missing)")
    args = p.parse_args(argv)
    from vllm_kvbm.tools.local_model_archs import GEMMA3_DIR, build_gemma3

    model = args.model or str(build_gemma3(REPO / GEMMA3_DIR))
    cores = len(os.sched_getaffinity(0))
    # both engines on the same cores (vLLM reserves one more for a connector's otherwise)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{max(0, cores - 1)}"
    rng = random.Random(7)
    prompts = [[rng.randrange(10, 7000) for _ in range(args.tokens)] for _ in range(args.prompts)]
    on = run_mode(model, True, prompts)
    off = run_mode(model, False, prompts)
    print(f"\nGemma 3-shaped model, {args.tokens}-token prompts, median of {args.prompts}:")
    print(f"{'':34}{'HMA on':>12}{'HMA off':>12}{'on/off':>9}")
    for name, key, scale, unit in (
        ("bytes stored per cached token", "bytes_per_token", 1, ""),
        ("tokens a hit loads from KVBM", "hit_tokens", 1, ""),
        ("TTFT, miss (computed, stored)", "miss_s", 1e3, " ms"),
        ("TTFT, hit from the host tier", "hit_s", 1e3, " ms"),
    ):
        a, b = on[key] * scale, off[key] * scale
        print(f"{name:34}{a:>9.0f}{unit:3}{b:>9.0f}{unit:3}{a / b:>9.2f}")
    # the full-attention layer's share is the same in both: one layer of six
    full = off["bytes_per_token"] / 6
    sliding = (on["bytes_per_token"] - full) / (5 * full)
    print(f"sliding layers, HMA on: {sliding:.0%} of their KV stored (HMA off: 100%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
