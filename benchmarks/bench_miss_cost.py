"""What storing costs a miss: the same fresh prompts, alternately, to a plain
engine and to one with KVBM (host tier; ``--disk``: and a disk tier every stored page is written through
to), on the same cores.

Both engines run in this process (one engine-core process each, started with
the same binding), take turns prompt by prompt (the order flips every pair,
so a drift of the machine's speed hits both alike), and every prompt is new
to both: each request is a full prefill, and KVBM's stores of it are the only
work that differs. Printed per prompt length: the median TTFT of each, the
ratio of the medians, and the median and spread (min, max) of the pairs'
ratios; then the same for a batch of concurrent misses (``--batch`` prompts
in one call).

Bindings (``--binding``):
- ``all``: every core to OpenMP (``VLLM_CPU_OMP_THREADS_BIND=0-N``), what a
  user who binds the engine to the machine gets: KVBM's threads share the
  cores with the forward pass.
- ``reserved``: one core kept out of OpenMP (``VLLM_CPU_NUM_OF_RESERVED_CPU=1``,
  what vLLM gives a plain engine by default), where KVBM's threads can run.

    .venv/bin/python benchmarks/bench_miss_cost.py [--binding all reserved]
        [--lengths 2048 8192] [--pairs 10] [--batch 4] [--model PATH]
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


def bindings(name: str) -> dict[str, str]:
    cores = os.cpu_count() or 1
    if name == "all":
        return {"VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}"}
    return {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


def engine(model: str, longest: int, kvbm: bool, disk: str | None = None):
    from vllm import LLM

    from vllm_kvbm.tools.compute_dtype import compute_dtype
    from vllm_kvbm.tools.server import kvbm_transfer_config

    extra = {}
    if kvbm:
        tiers = {"disk_cache_dir": disk, "disk_cache_size": "16GiB"} if disk else {}
        extra["kv_transfer_config"] = kvbm_transfer_config(host_cache_size="4GiB", **tiers)
    return LLM(
        model=model,
        dtype=compute_dtype(),
        block_size=BLOCK_SIZE,
        enforce_eager=True,
        max_model_len=longest + BLOCK_SIZE,
        max_num_batched_tokens=max(8192, longest),
        kv_cache_memory_bytes=1 << 30,
        gpu_memory_utilization=0.3,
        seed=0,
        **extra,
    )


def timed(llm, prompts: list[list[int]]) -> float:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start


def alternate(
    plain, kvbm, length: int, pairs: int, batch: int, seed: int
) -> tuple[list[float], list[float]]:
    """TTFTs (s) of ``pairs`` fresh misses of ``batch`` prompts each, the same
    prompts to both engines, in alternating order."""
    rng = random.Random(seed)
    times_plain, times_kvbm = [], []
    for i in range(pairs):
        prompts = [[rng.randrange(10, 7000) for _ in range(length)] for _ in range(batch)]
        order = [(plain, times_plain), (kvbm, times_kvbm)]
        for llm, times in order if i % 2 == 0 else order[::-1]:
            times.append(timed(llm, prompts))
    return times_plain, times_kvbm


def row(label: str, plain: list[float], kvbm: list[float]) -> str:
    ratios = sorted(k / p for p, k in zip(plain, kvbm))
    mp, mk = statistics.median(plain), statistics.median(kvbm)
    return (
        f"| {label} | {len(ratios)} | {mp * 1000:.0f} ms | {mk * 1000:.0f} ms "
        f"| {mk / mp:.3f} | {statistics.median(ratios):.3f} "
        f"| {ratios[0]:.3f} - {ratios[-1]:.3f} |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--binding", choices=["all", "reserved"], default="all")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--pairs", type=int, default=10)
    p.add_argument("--batch", type=int, default=4, help="prompts per call in the batch rows")
    p.add_argument("--batch-length", type=int, default=2048)
    p.add_argument(
        "--disk",
        action="store_true",
        help="KVBM with a disk tier too (a temporary directory): every stored page written through",
    )
    args = p.parse_args()
    if args.pairs < 2:
        p.error("--pairs: at least 2")
    if args.model is None:
        from vllm_kvbm.tools.local_model import DEFAULT_DIR, build

        args.model = str(build(DEFAULT_DIR))
    env = bindings(args.binding)
    os.environ.update(env)
    from vllm_kvbm.bench.cores import process_binding
    from vllm_kvbm.tools.compute_dtype import describe

    longest = max(args.lengths + [args.batch_length])
    plain = engine(args.model, longest, kvbm=False)
    disk = tempfile.mkdtemp(prefix="kvbm-bench-disk-") if args.disk else None
    kvbm = engine(args.model, longest, kvbm=True, disk=disk)
    for llm in (plain, kvbm):  # warm up: first-call allocations, NIXL handles
        timed(llm, [[11] * 256])
    rows = []
    for length in args.lengths:
        rows.append(
            row(f"{length} tokens", *alternate(plain, kvbm, length, args.pairs, 1, seed=length))
        )
    if args.batch > 1:
        rows.append(
            row(
                f"{args.batch} x {args.batch_length} tokens at once",
                *alternate(
                    plain,
                    kvbm,
                    args.batch_length,
                    args.pairs,
                    args.batch,
                    seed=10**6 + args.batch_length,
                ),
            )
        )
    cores = process_binding(os.getpid())
    print()
    print(
        f"binding {args.binding}: {' '.join(f'{k}={v}' for k, v in env.items())} on "
        f"{os.cpu_count()} cores ({cores.describe() if cores else 'cores not read'}); "
        f"dtype {describe()}; KVBM host tier 4 GiB{', disk tier' if disk else ''}; "
        "TTFT of max_tokens=1"
    )
    print(
        "| misses | pairs | plain, median | KVBM, median | KVBM / plain (medians) "
        "| KVBM / plain, median pair | pair ratios, min - max |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for line in rows:
        print(line)
    for llm in (plain, kvbm):
        llm.llm_engine.engine_core.shutdown()
    if disk:
        shutil.rmtree(disk, ignore_errors=True)


if __name__ == "__main__":
    main()
