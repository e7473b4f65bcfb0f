"""TTFT of a hit read from a peer's pool, next to a hit from the engine's own
host tier, a hit from Redis and a recompute, at 2k and 8k tokens.

Two engines in this process (each its own engine-core process, the same
cores): A keeps its pages in its shared pool, served to peers on 127.0.0.1
(pool_serve_port), and writes them through to a Redis server started here;
B reads peers (peer_reads) and the same Redis. For each prompt A computes it
once; then B, alternating, prompt by prompt: recomputes it (a request that
neither loads nor stores), reads it from A's pool on a router's hint (its host
tier and vLLM's cache emptied first), hits it in its own host tier (vLLM's
cache emptied: the peer's pages are there now), and reads it from Redis (its
host tier emptied). TTFT is the wall time of one greedy token. Medians of
--prompts prompts per length, and the ratios, from one run. Both engines get
the binding a plain engine gets (bench/cores.py ``fair_cpu_env``): on a CPU
with a core left free of vLLM's OpenMP threads, host, disk and peer hits
load layer by layer during their step.

    .venv/bin/python benchmarks/bench_peer_ttft.py [--tokens 2048 8192] [--prompts 5]
        [--dtype float32] [--ucx-tls tcp]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import tempfile
import time

BLOCK_SIZE = 128
RECOMPUTE = {"max_load_tokens": 0, "lmcache.skip_save": True}


def timed(llm, prompt, params: dict | None = None) -> tuple[float, int]:
    """(seconds to the first token, prompt tokens that came from a cache)."""
    from vllm import SamplingParams

    sp = SamplingParams(
        temperature=0.0, max_tokens=1, extra_args={"kv_transfer_params": params} if params else None
    )
    start = time.perf_counter()
    (out,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    return time.perf_counter() - start, out.num_cached_tokens


def engine(model: str, dtype: str, max_len: int, extra: dict):
    from vllm import LLM

    from vllm_kvbm.tools.server import kvbm_transfer_config

    return LLM(
        model=model,
        dtype=dtype,
        max_model_len=max_len,
        max_num_batched_tokens=max_len,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=True,
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        kv_cache_memory_bytes=2 << 30,
        seed=0,
        kv_transfer_config=kvbm_transfer_config(load_split=False, **extra),
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", default=None, help="default: the local demo model")
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--prompts", type=int, default=5, help="prompts per length")
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--ucx-tls",
        default=None,
        help="UCX_TLS for both engines (tcp: as "
        "between machines; default: UCX's choice, cma on one machine)",
    )
    args = p.parse_args()
    if args.ucx_tls:
        os.environ["UCX_TLS"] = args.ucx_tls
    from vllm_kvbm.bench.cores import fair_cpu_env

    cpu_env = fair_cpu_env()
    os.environ.update(cpu_env)
    if args.model is None:
        from vllm_kvbm.tools.local_model import DEFAULT_DIR, build

        args.model = str(build(DEFAULT_DIR))
    from bench_tiers import start_redis

    from vllm_kvbm.tools.server import free_port, stop_process

    work = tempfile.mkdtemp(prefix="kvbm-bench-peer-", dir="/dev/shm")
    redis_port, serve_port = free_port(), free_port()
    redis = start_redis(redis_port, work)
    max_len = max(args.tokens) + 256
    pages = max(args.tokens) // BLOCK_SIZE + 1
    remote = f"redis://127.0.0.1:{redis_port}"
    a = b = None
    try:
        a = engine(
            args.model,
            args.dtype,
            max_len,
            dict(
                host_cache_blocks=pages,
                pool_cache_size=f"{4 * pages * 10}MiB",
                pool_dir=work,
                pool_serve_port=serve_port,
                pool_serve_host="127.0.0.1",
                remote_url=remote,
            ),
        )
        b = engine(
            args.model,
            args.dtype,
            max_len,
            dict(host_cache_blocks=pages, peer_reads=True, remote_url=remote),
        )
        hint = {
            "router_hint": {"source_control_endpoint": f"tcp://127.0.0.1:{serve_port}"},
            "kv_load_tiers": ["peer"],
        }
        rng = random.Random(0)
        timed(b, [7] * 300, RECOMPUTE)  # warm-up
        # B's first read from A (NIXL metadata, UCX's connection) loads before
        # its step; from a peer read lately, hits are read during their step
        warm = [rng.randrange(10, 7000) for _ in range(4 * BLOCK_SIZE + 1)]
        timed(a, warm)
        time.sleep(2.0)
        timed(a, [7] * 8)
        timed(b, warm, hint)
        rows = []
        for n in args.tokens:
            t: dict[str, list[float]] = {k: [] for k in ("recompute", "peer", "host", "redis")}
            hits: dict[str, set[int]] = {k: set() for k in t}
            for _ in range(args.prompts):
                prompt = [rng.randrange(10, 7000) for _ in range(n)]
                timed(a, prompt)  # A computes it: its pool and Redis get its pages
                time.sleep(2.0)
                timed(a, [7] * 8)  # a step collects the write-through
                for what, params, reset in (
                    ("recompute", RECOMPUTE, True),
                    ("peer", hint, True),
                    ("host", {"kv_load_tiers": ["host"]}, False),
                    ("redis", {"kv_load_tiers": ["remote"]}, True),
                ):
                    assert b.reset_prefix_cache(reset_connector=reset)
                    secs, cached = timed(b, prompt, params)
                    t[what].append(secs)
                    hits[what].add(cached)
            med = {k: statistics.median(v) for k, v in t.items()}
            rows.append((n, med, hits, t))
        print(
            f"\nmodel {args.model} ({args.dtype}), UCX_TLS={os.environ.get('UCX_TLS', '')!r}, "
            f"{' '.join(f'{k}={v}' for k, v in cpu_env.items())}, "
            f"{args.prompts} prompts per length, medians"
        )
        print(
            "| tokens | recompute | peer hit | host hit | Redis hit | peer / host | "
            "peer / Redis | recompute / peer |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for n, m, hits, t in rows:
            print(
                f"| {n} | {m['recompute'] * 1e3:.0f} ms | {m['peer'] * 1e3:.0f} ms | "
                f"{m['host'] * 1e3:.0f} ms | {m['redis'] * 1e3:.0f} ms | "
                f"{m['peer'] / m['host']:.2f}x | {m['peer'] / m['redis']:.2f}x | "
                f"{m['recompute'] / m['peer']:.2f}x |"
            )
        for n, m, hits, t in rows:
            print(
                f"{n} tokens: cached tokens per case {dict((k, sorted(v)) for k, v in hits.items())}; "
                + "; ".join(
                    f"{k} {', '.join(f'{x * 1e3:.0f}' for x in v)} ms" for k, v in t.items()
                )
            )
    finally:
        for llm in (b, a):
            if llm is not None:
                llm.llm_engine.engine_core.shutdown()
        stop_process(redis)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
