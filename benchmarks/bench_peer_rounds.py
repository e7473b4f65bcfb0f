"""Multi-round chats whose rounds alternate between two engines, as a router
without KV awareness sends them: mean TTFT with the peer tier and without.

Two engines (each its own engine-core process, the same cores), standing for
two machines: each keeps its pages in a pool of its own (its own pool_dir),
served to peers on 127.0.0.1, and lists them in a peer directory (a Redis
server started here); each reads peers (peer_reads). No request carries a
hint: the directory says which engine holds a page. Without the peer tier the
same engines have their host tier only.

The bound: the same rounds all sent to one engine, which finds every earlier
round in vLLM's own cache (what a KV-aware router that keeps a user on one
engine gets): the peer tier can come close to it, not beyond. Every engine
gets the binding a plain engine gets (bench/cores.py ``fair_cpu_env``).

Each user's first prompt is a shared system prompt and a question; each next
round adds an answer and a new question, so round r's prompt is the whole
conversation so far. Round r of user u goes to engine (u + r) % 2: the engine
that gets a round has never seen the previous one, whose pages are in the
other engine's pool. The answers are fixed tokens (a random-weight model's
text would be noise anyway), and TTFT is the time of one greedy token.

    .venv/bin/python benchmarks/bench_peer_rounds.py [--users 4] [--rounds 5]
        [--system 1024] [--question 512] [--answer 128] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BLOCK_SIZE = 128


def conversations(args) -> list[list[list[int]]]:
    """Per user, the prompt of each round (token ids)."""
    rng = random.Random(0)
    system = [rng.randrange(10, 7000) for _ in range(args.system)]
    users = []
    for _ in range(args.users):
        history, prompts = list(system), []
        for r in range(args.rounds):
            if r:
                history += [rng.randrange(10, 7000) for _ in range(args.answer)]
            history += [rng.randrange(10, 7000) for _ in range(args.question)]
            prompts.append(list(history))
        users.append(prompts)
    return users


def run_config(args) -> dict:
    """One configuration's run (in a process of its own): TTFTs and cached tokens."""
    from vllm import LLM, SamplingParams

    from vllm_kvbm.tools.server import free_port, kvbm_transfer_config, stop_process

    if args.model is None:
        from vllm_kvbm.tools.local_model import DEFAULT_DIR, build

        args.model = str(build(DEFAULT_DIR))
    users = conversations(args)
    longest = max(len(p) for u in users for p in u)
    pages = args.users * longest // BLOCK_SIZE + 8
    work = tempfile.mkdtemp(prefix="kvbm-bench-rounds-", dir="/dev/shm")
    redis = None
    engines = []
    try:
        extras = [dict(host_cache_blocks=pages) for _ in range(2)]
        if args.config == "peer":
            from bench_tiers import start_redis

            redis_port = free_port()
            redis = start_redis(redis_port, work)
            for i, extra in enumerate(extras):
                pool_dir = os.path.join(work, f"machine{i}")
                os.mkdir(pool_dir)
                extra.update(
                    pool_cache_size=f"{pages * 10}MiB",
                    pool_dir=pool_dir,
                    pool_serve_port=free_port(),
                    pool_serve_host="127.0.0.1",
                    peer_reads=True,
                    peer_directory_url=f"redis://127.0.0.1:{redis_port}",
                )
        for extra in extras:
            engines.append(
                LLM(
                    model=args.model,
                    dtype=args.dtype,
                    max_model_len=longest + BLOCK_SIZE,
                    max_num_batched_tokens=longest + BLOCK_SIZE,
                    block_size=BLOCK_SIZE,
                    enable_prefix_caching=True,
                    enforce_eager=True,
                    gpu_memory_utilization=0.3,
                    kv_cache_memory_bytes=2 << 30,
                    seed=0,
                    kv_transfer_config=kvbm_transfer_config(load_split=False, **extra),
                )
            )
        params = SamplingParams(temperature=0.0, max_tokens=1)
        for llm in engines:  # warm up
            llm.generate([{"prompt_token_ids": [7] * 300}], params, use_tqdm=False)
        rows = []
        for r in range(args.rounds):
            for u, prompts in enumerate(users):
                llm = engines[0 if args.config == "one" else (u + r) % 2]
                start = time.perf_counter()
                (out,) = llm.generate([{"prompt_token_ids": prompts[r]}], params, use_tqdm=False)
                rows.append(
                    {
                        "round": r,
                        "user": u,
                        "tokens": len(prompts[r]),
                        "ttft": time.perf_counter() - start,
                        "cached": out.num_cached_tokens or 0,
                    }
                )
                time.sleep(args.gap)  # the write-through and the directory entries land
        return {"config": args.config, "rows": rows}
    finally:
        for llm in engines:
            llm.llm_engine.engine_core.shutdown()
        if redis is not None:
            stop_process(redis)
        shutil.rmtree(work, ignore_errors=True)


def summary(result: dict, rounds: int) -> tuple[float, list[float], list[int]]:
    rows = result["rows"]
    per_round = [statistics.mean(x["ttft"] for x in rows if x["round"] == r) for r in range(rounds)]
    cached = [sum(x["cached"] for x in rows if x["round"] == r) for r in range(rounds)]
    return statistics.mean(x["ttft"] for x in rows), per_round, cached


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", default=None, help="default: the local demo model")
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--system", type=int, default=1024, help="system prompt tokens")
    p.add_argument("--question", type=int, default=512, help="new tokens per round")
    p.add_argument("--answer", type=int, default=128, help="answer tokens per round")
    p.add_argument("--gap", type=float, default=0.5, help="seconds between requests")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--config", choices=["peer", "local", "one"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.users < 2 or args.rounds < 2:
        p.error("--users and --rounds: at least 2 (rounds alternate between two engines)")
    if args.config:
        sys.path.insert(0, str(HERE))
        Path(args.out).write_text(json.dumps(run_config(args)))
        return
    from vllm_kvbm.bench.cores import fair_cpu_env

    cpu_env = fair_cpu_env()
    os.environ.update(cpu_env)  # the runs below inherit it
    results = {}
    for config in ("local", "peer", "one"):  # each in a fresh process: the same start for all
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            cmd = [sys.executable, __file__, *sys.argv[1:], "--config", config, "--out", out.name]
            subprocess.run(cmd, check=True)
            results[config] = json.loads(Path(out.name).read_text())
    local, peer, one = (summary(results[c], args.rounds) for c in ("local", "peer", "one"))
    print(
        f"\n{args.users} users x {args.rounds} rounds alternating between two engines; "
        f"system {args.system}, question {args.question}, answer {args.answer} tokens; "
        f"dtype {args.dtype}; {os.cpu_count()} cores, "
        f"{' '.join(f'{k}={v}' for k, v in cpu_env.items())}"
    )
    print(
        "| round | prompt tokens | mean TTFT, host tier only | mean TTFT, peer tier "
        "| without / with | one engine (bound) | with / bound | cached tokens, without / with |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in range(args.rounds):
        n = statistics.mean(x["tokens"] for x in results["peer"]["rows"] if x["round"] == r)
        print(
            f"| {r} | {n:.0f} | {local[1][r] * 1e3:.0f} ms | {peer[1][r] * 1e3:.0f} ms "
            f"| {local[1][r] / peer[1][r]:.2f}x | {one[1][r] * 1e3:.0f} ms "
            f"| {peer[1][r] / one[1][r]:.2f}x | {local[2][r]} / {peer[2][r]} |"
        )
    print(
        f"| all | | {local[0] * 1e3:.0f} ms | {peer[0] * 1e3:.0f} ms "
        f"| {local[0] / peer[0]:.2f}x | {one[0] * 1e3:.0f} ms | {peer[0] / one[0]:.2f}x "
        f"| {sum(local[2])} / {sum(peer[2])} |"
    )


if __name__ == "__main__":
    main()
