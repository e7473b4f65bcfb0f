"""TTFT of a hit from each tier next to recompute and vLLM's own prefix hit.

One engine with the host, disk and remote tiers (an LMCache server started
here on 127.0.0.1); one prompt length; ratios printed from one run. Also the
read bandwidth of each lower tier for one block-sized page. The engine gets
the cores vLLM gives an engine without a connector (see bench_host_tier.py);
they are read from its log and printed.

    .venv/bin/python benchmarks/bench_tiers.py [--tokens 8192] [--model PATH]
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path

BLOCK_SIZE = 128


def ttft(llm, prompt) -> float:
    from vllm import SamplingParams

    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=1),
                 use_tqdm=False)
    return time.perf_counter() - start


def settle(llm, host_blocks: int, rng: random.Random) -> None:
    """Lets write-through to the lower tiers land, then pushes everything out
    of the host tier with fresh prompts and clears vLLM's own prefix cache.
    (A connector reset would move KVBM's keys to a new epoch: nothing from
    before it would be found in any tier.)"""
    time.sleep(2.0)
    ttft(llm, [7] * 8)
    for _ in range(2):
        ttft(llm, [rng.randrange(10, 7000) for _ in range((host_blocks // 2 + 2) * BLOCK_SIZE)])
    time.sleep(2.0)
    ttft(llm, [7] * 8)
    llm.reset_prefix_cache()


def tier_bandwidth(store, block_bytes: int, pages: int = 32) -> float:
    import torch

    keys = [os.urandom(32) for _ in range(pages)]
    page = torch.randint(0, 255, (block_bytes,), dtype=torch.uint8)
    for key in keys:
        store.put(key, page)
    time.sleep(1.0)
    out = torch.empty(block_bytes, dtype=torch.uint8)
    start = time.perf_counter()
    ok = sum(store.get_into(key, out) == "ok" for key in keys)
    elapsed = time.perf_counter() - start
    return ok * block_bytes / elapsed / 1e9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    if args.model is None:
        from vllm_kvbm.tools.local_model import DEFAULT_DIR, build

        args.model = str(build(DEFAULT_DIR))
    from vllm_kvbm.bench.cores import fair_cpu_env, read_binding, teed_output

    cpu_env = fair_cpu_env()
    os.environ.update(cpu_env)
    log = tempfile.NamedTemporaryFile(prefix="bench-tiers-", suffix=".log", delete=False)
    with teed_output(log.name):
        t, bw = measure(args)
    binding = read_binding(log.name)
    print()
    print(f"engine: {binding.describe() if binding else 'cores unknown (no binding line)'}, "
          f"started with {' '.join(f'{k}={v}' for k, v in cpu_env.items())} "
          f"on {os.cpu_count()} cores; log {log.name}")
    report(args, t, bw)


def measure(args) -> tuple[dict, dict]:
    from vllm import LLM

    from vllm_kvbm.tools.server import free_port, kvbm_transfer_config, start_lmcache_server
    from vllm_kvbm.tools.server import stop_process as stop
    from vllm_kvbm.tiers.disk import DiskStore
    from vllm_kvbm.tiers.remote import RemoteStore

    port = free_port()
    server = start_lmcache_server(port)
    disk = Path(tempfile.mkdtemp(prefix="kvbm-bench-disk-"))
    try:
        # Read bandwidth of one block-sized page (2 MiB on the local model).
        block_bytes = 2 << 20
        disk_store = DiskStore(str(disk / "bw"), 1 << 30, block_bytes, "bench", 0, 1)
        remote_store = RemoteStore(f"lm://127.0.0.1:{port}", block_bytes, "bench", 0, 1)
        bw = {"disk": tier_bandwidth(disk_store, block_bytes),
              "remote": tier_bandwidth(remote_store, block_bytes)}
        disk_store.close()
        remote_store.close()

        host_blocks = args.tokens // BLOCK_SIZE + 8  # the prompt, and fresh prompts push it out
        llm = LLM(model=args.model, dtype="bfloat16", block_size=BLOCK_SIZE, enforce_eager=True,
                  max_model_len=args.tokens + BLOCK_SIZE, max_num_batched_tokens=8192,
                  kv_cache_memory_bytes=1 << 30, gpu_memory_utilization=0.3,
                  kv_transfer_config=kvbm_transfer_config(
                      host_cache_blocks=host_blocks, disk_cache_dir=str(disk),
                      disk_cache_size="4GiB", remote_url=f"lm://127.0.0.1:{port}"))
        ttft(llm, [11] * 64)
        rng = random.Random(args.tokens)
        prompt = [rng.randrange(10, 7000) for _ in range(args.tokens)]
        before = set(disk.glob("*.pt"))
        t = {"miss": ttft(llm, prompt)}
        time.sleep(1.0)
        t["vLLM prefix hit"] = ttft(llm, prompt)
        llm.reset_prefix_cache()
        t["host hit"] = ttft(llm, prompt)
        settle(llm, host_blocks, rng)
        t["disk hit"] = ttft(llm, prompt)
        settle(llm, host_blocks, rng)
        for path in set(disk.glob("*.pt")) - before:
            path.unlink()  # only the server has the prompt now
        t["remote hit"] = ttft(llm, prompt)
        llm.llm_engine.engine_core.shutdown()
    finally:
        stop(server)
    return t, bw


def report(args, t: dict, bw: dict) -> None:
    print()
    print(f"prompt: {args.tokens} tokens, {args.tokens // BLOCK_SIZE} blocks of 2 MiB")
    print("| path | TTFT | miss / this |")
    print("|---|---:|---:|")
    for name, seconds in t.items():
        print(f"| {name} | {seconds * 1000:.0f} ms | {t['miss'] / seconds:.1f}x |")
    print()
    print(f"lower-tier read bandwidth, 2 MiB pages: disk {bw['disk']:.2f} GB/s, "
          f"remote (lm:// on loopback) {bw['remote']:.2f} GB/s")


if __name__ == "__main__":
    main()
