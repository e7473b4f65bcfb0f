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
import time

from bench_tiers import reset, ttft  # noqa: E402 (this directory: the script's own)

BLOCK_SIZE = 128


def bench_ttft(model: str, lengths: list[int]) -> tuple[list[tuple], object]:
    """The rows, and the cores the engine ran on (read while it runs)."""
    from vllm import LLM

    from vllm_kvbm.bench.cores import process_binding
    from vllm_kvbm.tools.server import kvbm_transfer_config

    longest = max(lengths)
    from vllm_kvbm.tools.compute_dtype import compute_dtype, describe

    print(f"dtype: {describe()}", flush=True)
    llm = LLM(
        model=model,
        dtype=compute_dtype(),
        block_size=BLOCK_SIZE,
        enforce_eager=True,
        max_model_len=longest + BLOCK_SIZE,
        max_num_batched_tokens=8192,
        kv_cache_memory_bytes=2 << 30,
        gpu_memory_utilization=0.3,
        kv_transfer_config=kvbm_transfer_config(host_cache_size="4GiB"),
    )
    ttft(llm, [11] * 64)  # warm up
    binding = process_binding(os.getpid())  # this process's engine core and its workers
    rows = []
    for n in lengths:
        rng = random.Random(n)
        prompt = [rng.randrange(10, 7000) for _ in range(n)]
        miss = ttft(llm, prompt)  # computes everything, offloads it
        time.sleep(0.5)  # let the stores of the last blocks land
        local = ttft(llm, prompt)  # vLLM's own prefix cache
        reset(llm)
        host = ttft(llm, prompt)  # onboarded from the host tier
        rows.append((n, miss, local, host))
    llm.llm_engine.engine_core.shutdown()
    return rows, binding


def bench_bandwidth(
    num_blocks: int = 128, layers: int = 8, page: int = 256 << 10, rounds: int = 7
) -> tuple[int, dict[str, dict[str, tuple[float, float]]]]:
    """Host pool <-> KV cache layout (8 layers of one page per block), in
    interleaved rounds so that other work on the machine hits every path
    alike: a single-threaded memcpy of the same bytes (one contiguous run),
    torch ``copy_`` per block, NIXL as the connector used it before
    (``loopback="default"``: UCX picks cma, loads are READs), as it does now
    (``loopback="self"``), the same posted from a copy thread, and plain
    copies shared by the posting thread and helper threads (host_copies.py,
    one thread per core up to 4). Returns
    bytes per transfer and, per path and direction, (best, median) GB/s."""
    import ctypes

    import torch

    from vllm_kvbm.worker.host_copies import HostCopies
    from vllm_kvbm.worker.page_mover import PageMover

    kv = torch.randint(-128, 127, (layers, num_blocks, page), dtype=torch.int8)
    caches = {f"layer{i}": kv[i].view(num_blocks, page) for i in range(layers)}
    pool = torch.randint(0, 255, (num_blocks, layers * page), dtype=torch.uint8)
    blocks = list(range(num_blocks))
    slots = list(reversed(blocks))
    nbytes = num_blocks * layers * page
    pool_pages = pool.view(num_blocks, layers, page)
    kv_u8 = kv.view(torch.uint8)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)

    def memcpy():
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)

    # The same pages as the transfers, one memmove each (glibc picks its store
    # kind by size: one 256 MiB run and 256 KiB pieces copy differently).
    pages = [
        (kv_u8[i, b].data_ptr(), pool_pages[s, i].data_ptr())
        for b, s in zip(blocks, slots)
        for i in range(layers)
    ]

    def memcpy_pages(to_host: bool):
        for kv_ptr, host_ptr in pages:
            if to_host:
                ctypes.memmove(host_ptr, kv_ptr, page)
            else:
                ctypes.memmove(kv_ptr, host_ptr, page)

    def torch_copy(to_host: bool):
        for b, s in zip(blocks, slots):
            if to_host:
                pool_pages[s].copy_(kv_u8[:, b])
            else:
                kv_u8[:, b].copy_(pool_pages[s])

    def nixl_copy(mover, to_host: bool):
        handle = mover.post(to_host, blocks, slots)
        # Polled as the worker polls (it never spins holding the GIL, which
        # the copy thread needs between NIXL calls).
        while mover.poll(handle) == "PROC":
            time.sleep(0.0002)

    movers = {
        "NIXL before (UCX default: cma, loads READ)": PageMover(
            caches, num_blocks, pool, name="bench-default", loopback="default"
        ),
        "NIXL now (UCX self, loads WRITE, in the posting thread)": PageMover(
            caches, num_blocks, pool, name="bench-self", loopback="self"
        ),
        "NIXL self posted from a copy thread (copy_thread=True)": PageMover(
            caches, num_blocks, pool, name="bench-thread", copy_thread=True
        ),
    }
    threaded = HostCopies(caches, num_blocks, pool)
    movers[f"memory copies shared by {threaded.threads} threads (HostCopies)"] = threaded
    paths = {
        "memcpy (one thread, same bytes, contiguous)": {"load": memcpy, "store": memcpy},
        "memcpy per page (one thread, the same pages)": {
            "load": lambda: memcpy_pages(False),
            "store": lambda: memcpy_pages(True),
        },
        "torch copy_ per block": {
            "load": lambda: torch_copy(False),
            "store": lambda: torch_copy(True),
        },
    }
    for label, mover in movers.items():
        paths[label] = {
            "load": lambda m=mover: nixl_copy(m, False),
            "store": lambda m=mover: nixl_copy(m, True),
        }
    times: dict[tuple[str, str], list[float]] = {}
    for label, fns in paths.items():
        for direction, fn in fns.items():
            fn()  # warm up: page faults, NIXL handles
            times[label, direction] = []
    for _ in range(rounds):
        for label, fns in paths.items():
            for direction, fn in fns.items():
                start = time.perf_counter()
                fn()
                times[label, direction].append(time.perf_counter() - start)
    # The last copy of every path leaves block 0 holding slot num_blocks - 1.
    assert torch.equal(kv_u8[:, 0], pool_pages[num_blocks - 1])
    for mover in movers.values():
        mover.close()
    results: dict[str, dict[str, tuple[float, float]]] = {}
    for (label, direction), ts in times.items():
        ts.sort()
        results.setdefault(label, {})[direction] = (
            nbytes / ts[0] / 1e9,
            nbytes / ts[len(ts) // 2] / 1e9,
        )
    return nbytes, results


def print_bandwidth(nbytes: int, results: dict[str, dict[str, tuple[float, float]]]) -> None:
    flat = results["memcpy (one thread, same bytes, contiguous)"]["load"][1]
    paged = results["memcpy per page (one thread, the same pages)"]
    print(
        f"host pool <-> KV cache, {nbytes / 2**20:.0f} MiB per transfer in {BLOCK_SIZE}-token "
        f"blocks (8 layers x 256 KiB pages); GB/s best / median of interleaved rounds; "
        f"ratios of medians to a contiguous memcpy and to a memcpy of the same pages"
    )
    print(
        "| path | load (host -> KV) | store (KV -> host) | load, store / contiguous memcpy "
        "| load, store / per-page memcpy |"
    )
    print("|---|---:|---:|---:|---:|")
    for label, r in results.items():
        (lb, lm), (sb, sm) = r["load"], r["store"]
        print(
            f"| {label} | {lb:.2f} / {lm:.2f} | {sb:.2f} / {sm:.2f} "
            f"| {lm / flat:.2f}, {sm / flat:.2f} "
            f"| {lm / paged['load'][1]:.2f}, {sm / paged['store'][1]:.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384])
    parser.add_argument(
        "--bandwidth-only", action="store_true", help="only the copy bandwidth table (no engine)"
    )
    args = parser.parse_args()
    if args.bandwidth_only:
        print_bandwidth(*bench_bandwidth())
        return
    if args.model is None:
        from vllm_kvbm.tools.local_model import DEFAULT_DIR, build

        args.model = str(build(DEFAULT_DIR))

    # Bandwidth first: after an engine ran in this process, torch's own copy
    # threads are configured for the engine and the comparison is skewed.
    nbytes, bw = bench_bandwidth()
    from vllm_kvbm.bench.cores import fair_cpu_env

    cpu_env = fair_cpu_env()
    os.environ.update(cpu_env)
    rows, binding = bench_ttft(args.model, args.lengths)
    print()
    print(
        f"engine: {binding.describe() if binding else 'cores not read'}, "
        f"started with {' '.join(f'{k}={v}' for k, v in cpu_env.items())} "
        f"on {os.cpu_count()} cores"
    )
    print()
    print(
        "| prompt tokens | miss (recompute) | vLLM prefix hit | KVBM host hit | miss / host hit | host hit / vLLM hit |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for n, miss, local, host in rows:
        print(
            f"| {n} | {miss * 1000:.0f} ms | {local * 1000:.0f} ms | {host * 1000:.0f} ms "
            f"| {miss / host:.1f}x | {host / local:.2f}x |"
        )
    print()
    print_bandwidth(nbytes, bw)


if __name__ == "__main__":
    main()
