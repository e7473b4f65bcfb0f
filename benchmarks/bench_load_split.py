"""Never slower than recompute: TTFT of returning prompts with a fast and a slow remote tier.

One engine with a small host tier and an LMCache server (127.0.0.1) behind a
proxy that paces the server's replies (tests/helpers/throttled_proxy.py). Each case
computes a prompt, pushes it out of the host tier and vLLM's cache, times a
fresh prompt as long (the miss: recompute), and sends the first again:

- fast link: the whole prefix is loaded from the server;
- slow link, first return: the engine still believes the tier is fast (what
  a connector without the split pays on every return);
- slow link, later returns: once the learned costs say recompute (the
  newest load weighs half), it does;
- slow link, hot system prompt: its blocks are in the host tier, the rest
  only on the slow server: the host part is loaded, the rest recomputed.

Ratios are printed against each prompt's own miss, from one run.

    .venv/bin/python benchmarks/bench_load_split.py [--tokens 2048] [--slow-rate-mb 4]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from bench_tiers import ttft  # noqa: E402 (this directory: the script's own)

BLOCK_SIZE = 128


def counter(name: str) -> float:
    from prometheus_client import REGISTRY

    return sum(
        s.value for m in REGISTRY.collect() for s in m.samples if s.name == f"kvbm_{name}_total"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument(
        "--slow-rate-mb",
        type=float,
        default=4.0,
        help="the slow link's pace of server replies, MB/s",
    )
    args = parser.parse_args()
    if args.model is None:
        from vllm_kvbm.tools.local_model import DEFAULT_DIR, build

        args.model = str(build(DEFAULT_DIR))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
    rows = measure(args)
    print()
    print(
        f"prompt: {args.tokens} tokens; slow link {args.slow_rate_mb:g} MB/s; "
        f"VLLM_CPU_OMP_THREADS_BIND={os.environ['VLLM_CPU_OMP_THREADS_BIND']}"
    )
    print(
        "| case | miss (recompute) | return | return / miss | loaded tokens "
        "| recomputed on purpose |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, miss, back, loaded, chosen in rows:
        print(
            f"| {name} | {miss * 1000:.0f} ms | {back * 1000:.0f} ms | {back / miss:.2f}x "
            f"| {loaded:.0f} | {chosen:.0f} |"
        )


def measure(args) -> list[tuple]:
    from vllm import LLM

    from helpers.throttled_proxy import ThrottledProxy
    from vllm_kvbm.tools.server import free_port, kvbm_transfer_config, start_lmcache_server
    from vllm_kvbm.tools.server import stop_process as stop

    port = free_port()
    server = start_lmcache_server(port)
    proxy = ThrottledProxy(port, rate=None)
    rng = random.Random(args.tokens)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(10, 7000) for _ in range(n)]

    # The prompt fits the host tier; two fresh prompts push it out.
    host_blocks = args.tokens // BLOCK_SIZE + 16
    filler_blocks = host_blocks // 2 + 2
    try:
        from vllm_kvbm.tools.compute_dtype import compute_dtype, describe

        print(f"dtype: {describe()}", flush=True)
        llm = LLM(
            model=args.model,
            dtype=compute_dtype(),
            block_size=BLOCK_SIZE,
            enforce_eager=True,
            max_model_len=max(args.tokens, filler_blocks * BLOCK_SIZE) + BLOCK_SIZE,
            max_num_batched_tokens=8192,
            kv_cache_memory_bytes=1 << 30,
            gpu_memory_utilization=0.3,
            disable_log_stats=False,
            kv_transfer_config=kvbm_transfer_config(
                host_cache_blocks=host_blocks,
                remote_url=f"lm://127.0.0.1:{proxy.port}",
                remote_timeout_s=60,
            ),
        )

        def evict() -> None:
            """Only the server keeps what came before: fresh prompts push it
            out of the host tier, then vLLM's own cache is cleared."""
            time.sleep(1.0)
            for _ in range(2):
                ttft(llm, fresh(filler_blocks * BLOCK_SIZE))
            time.sleep(1.0)
            llm.reset_prefix_cache()

        def case(name: str, prompt, before_return=None) -> tuple:
            ttft(llm, prompt)  # computed and stored (host tier, then the server)
            evict()
            if before_return is not None:
                before_return()
            # The recompute it is compared with: a fresh prompt as long, right
            # before the return (these machines are noisy; neighbours compare).
            miss = ttft(llm, fresh(len(prompt)))
            loaded, chosen = counter("matched_tokens"), counter("recompute_chosen_tokens")
            back = ttft(llm, prompt)
            return (
                name,
                miss,
                back,
                counter("matched_tokens") - loaded,
                counter("recompute_chosen_tokens") - chosen,
            )

        ttft(llm, fresh(64))  # warm-up
        rows = [case("fast link", fresh(args.tokens))]
        proxy.rate = args.slow_rate_mb * 1e6
        rows.append(case("slow link, first return (believed fast)", fresh(args.tokens)))
        rows.append(case("slow link, second return", fresh(args.tokens)))
        rows.append(case("slow link, third return", fresh(args.tokens)))
        system = fresh(args.tokens // 4 // BLOCK_SIZE * BLOCK_SIZE)
        prompt = system + fresh(args.tokens - len(system))

        def system_prompt_again() -> None:
            """Another conversation with the system prompt: recomputed (its
            blocks are only on the slow server) and so back in the host tier."""
            ttft(llm, system + fresh(65))
            time.sleep(1.0)
            llm.reset_prefix_cache()  # vLLM's own copy would hide the host tier's

        rows.append(
            case("slow link, system prompt hot in host", prompt, before_return=system_prompt_again)
        )
        llm.llm_engine.engine_core.shutdown()
        return rows
    finally:
        proxy.close()
        stop(server)


if __name__ == "__main__":
    main()
