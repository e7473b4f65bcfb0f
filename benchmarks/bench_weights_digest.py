"""What a worker's digest of the weights it runs costs (vllm_kvbm/worker/
loaded_weights.py: BLAKE3 over every parameter's and buffer's bytes, taken
at load and after each prefix-cache reset), one run. No engine.

Prints, median of --reps:

1. the local model (models/kvbm-llama-8l), its tensors in memory as vLLM
   holds them on a CPU: one digest pass, and the GB/s;
2. --size-gb of bfloat16 tensors in 64 MiB parameters (a larger model's
   shape): GB/s with BLAKE3 on all cores (used) and on one thread;
3. the expected pass over a 70B model's weights (140 GB) at those rates,
   and whether the local model's pass runs inline (under INLINE_DIGEST_BYTES)
   or on a thread of its own.

    .venv/bin/python benchmarks/bench_weights_digest.py [--size-gb 2] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from vllm_kvbm.worker.loaded_weights import INLINE_DIGEST_BYTES, weights_bytes, weights_digest

ROOT = Path(__file__).resolve().parent.parent
GB = 1e9
B70 = 70e9 * 2  # bytes of a 70B model in bf16


def local_model() -> torch.nn.Module:
    from safetensors.torch import load_file

    from vllm_kvbm.tools.local_model import build

    path = build(ROOT / "models" / "kvbm-llama-8l")
    model = torch.nn.Module()
    for i, (name, tensor) in enumerate(sorted(load_file(path / "model.safetensors").items())):
        model.register_parameter(f"p{i}", torch.nn.Parameter(tensor, requires_grad=False))
    return model


def synthetic(size_gb: float) -> torch.nn.Module:
    model = torch.nn.Module()
    per = 64 << 20  # bytes per parameter
    for i in range(max(1, int(size_gb * GB) // per)):
        model.register_parameter(
            f"p{i}",
            torch.nn.Parameter(torch.randn(per // 2, dtype=torch.bfloat16), requires_grad=False),
        )
    return model


def timed(model, reps: int, threads: int | None = None) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        weights_digest(model, threads)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()

    model = local_model()
    size = weights_bytes(model)
    seconds = timed(model, args.reps)
    print(
        f"local model: {size / 1e6:.1f} MB, digest {seconds * 1e3:.1f} ms "
        f"({size / seconds / GB:.2f} GB/s); runs "
        f"{'inline' if size <= INLINE_DIGEST_BYTES else 'on a thread'}"
    )

    big = synthetic(args.size_gb)
    size = weights_bytes(big)
    rates = {
        "all cores (used)": size / timed(big, args.reps) / GB,
        "one thread": size / timed(big, args.reps, threads=1) / GB,
    }
    for how, rate in rates.items():
        print(
            f"{size / GB:.2f} GB bf16, BLAKE3 {how}: {rate:.2f} GB/s; "
            f"a 70B model (140 GB) at this rate: {B70 / GB / rate:.0f} s"
        )


if __name__ == "__main__":
    main()
