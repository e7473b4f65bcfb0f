"""TTFT of a miss, a vLLM prefix hit and a KVBM host-tier hit; onboard bandwidth.

One run, one engine, ratios printed (these machines are noisy: compare the
ratios, not absolute times across runs). The engine gets the cores vLLM gives
an engine without a connector (``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` unless the
environment sets a binding: vLLM reserves one more core for an engine with a
kv_transfer_config, and on 2 cores that would leave none reserved and run the
KVBM engine on twice the cores of the plain one); the cores are read from the
engine's log and printed.

    .venv/bin/python benchmarks/bench_host_tier.py [--lengths 2048 8192 16384] [--model PATH]
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time

BLOCK_SIZE = 128


def ttft(llm, prompt: list[int]) -> float:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return time.perf_counter() - start


def bench_ttft(model: str, lengths: list[int]) -> list[tuple]:
    from vllm import LLM

    from vllm_kvbm.tools.server import kvbm_transfer_config

    longest = max(lengths)
    llm = LLM(model=model, dtype="bfloat16", block_size=BLOCK_SIZE, enforce_eager=True,
              max_model_len=longest + BLOCK_SIZE, max_num_batched_tokens=8192,
              kv_cache_memory_bytes=2 << 30, gpu_memory_utilization=0.3,
              kv_transfer_config=kvbm_transfer_config(host_cache_size="4GiB"))
    ttft(llm, [11] * 64)  # warm up
    rows = []
    for n in lengths:
        rng = random.Random(n)
        prompt = [rng.randrange(10, 7000) for _ in range(n)]
        miss = ttft(llm, prompt)       # computes everything, offloads it
        time.sleep(0.5)                # let the stores of the last blocks land
        local = ttft(llm, prompt)      # vLLM's own prefix cache
        llm.reset_prefix_cache()
        host = ttft(llm, prompt)       # onboarded from the host tier
        rows.append((n, miss, local, host))
    llm.llm_engine.engine_core.shutdown()
    return rows


def bench_bandwidth(num_blocks: int = 128, layers: int = 8, page: int = 256 << 10):
    """NIXL READ (host -> KV) versus torch copies of the same pages."""
    import torch

    from vllm_kvbm.worker.page_mover import PageMover

    kv = torch.randint(-128, 127, (layers, num_blocks, page), dtype=torch.int8)
    caches = {f"layer{i}": kv[i].view(num_blocks, page) for i in range(layers)}
    pool = torch.randint(0, 255, (num_blocks, layers * page), dtype=torch.uint8)
    mover = PageMover(caches, num_blocks, pool)
    blocks = list(range(num_blocks))
    slots = list(reversed(blocks))
    nbytes = num_blocks * layers * page

    def nixl_load():
        handle = mover.post(False, blocks, slots)
        while mover.poll(handle) == "PROC":
            pass

    pool_pages = pool.view(num_blocks, layers, page)
    kv_u8 = kv.view(torch.uint8)

    def torch_load():
        for b, s in zip(blocks, slots):
            kv_u8[:, b].copy_(pool_pages[s])

    results = {}
    for name, fn in (("nixl", nixl_load), ("torch", torch_load)):
        fn()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        results[name] = nbytes / sorted(times)[len(times) // 2] / 1e9
    assert torch.equal(kv_u8[:, 0], pool_pages[num_blocks - 1])
    mover.close()
    return nbytes, results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384])
    args = parser.parse_args()
    if args.model is None:
        from vllm_kvbm.tools.local_model import DEFAULT_DIR, build

        args.model = str(build(DEFAULT_DIR))

    # Bandwidth first: after an engine ran in this process, torch's own copy
    # threads are configured for the engine and the comparison is skewed.
    nbytes, bw = bench_bandwidth()
    from vllm_kvbm.bench.cores import fair_cpu_env, read_binding, teed_output

    cpu_env = fair_cpu_env()
    os.environ.update(cpu_env)
    log = tempfile.NamedTemporaryFile(prefix="bench-host-tier-", suffix=".log", delete=False)
    with teed_output(log.name):
        rows = bench_ttft(args.model, args.lengths)
    binding = read_binding(log.name)
    print()
    print(f"engine: {binding.describe() if binding else 'cores unknown (no binding line)'}, "
          f"started with {' '.join(f'{k}={v}' for k, v in cpu_env.items())} "
          f"on {os.cpu_count()} cores; log {log.name}")
    print()
    print("| prompt tokens | miss (recompute) | vLLM prefix hit | KVBM host hit | miss / host hit | host hit / vLLM hit |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n, miss, local, host in rows:
        print(f"| {n} | {miss * 1000:.0f} ms | {local * 1000:.0f} ms | {host * 1000:.0f} ms "
              f"| {miss / host:.1f}x | {host / local:.2f}x |")
    print()
    print(f"onboard bandwidth, {nbytes / 2**20:.0f} MiB in {BLOCK_SIZE}-token blocks: "
          f"NIXL {bw['nixl']:.2f} GB/s, torch copy {bw['torch']:.2f} GB/s, "
          f"NIXL / torch {bw['nixl'] / bw['torch']:.2f}")


if __name__ == "__main__":
    main()
