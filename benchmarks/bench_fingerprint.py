"""What fingerprinting the weights (vllm_kvbm/fingerprints.py) costs, one run.

No engine. Prints:

1. Hash throughput on one multi-GB file (--size-gb, written under --dir and
   deleted after): BLAKE3 memory-mapped on every core (what fingerprints.py
   uses), BLAKE3 on one thread, BLAKE3 over read() chunks, SHA-256 over
   read() chunks, and a plain read with no hash (the I/O ceiling), warm (the
   file in the page cache) and cold (its cached pages dropped with
   posix_fadvise(POSIX_FADV_DONTNEED) first). Median of --reps runs each.
2. Startup cost on the local model (models/kvbm-llama-8l): the model's
   fingerprint with an empty digest cache (first start on a host) and with a
   filled one (restarts, replicas, the worker processes after the scheduler).
3. The expected first-start cost of a 70B checkpoint (140 GB) at the rates
   measured here and at NVMe read speeds (the hash is no bottleneck there
   when it runs at least that fast on the host's cores).
4. The per-request cost of a LoRA adapter's fingerprint once known: a stat of
   the adapter's files (2 files) and a cache lookup.
5. What a worker adds to each adapter load vLLM makes (worker/lora_loads.py:
   two stats of the files and their fingerprint), for a --lora-mb adapter in
   the page cache: first on the host (its files hashed), loaded again by
   another process (the digest from the on-disk cache), and again by the
   same process (in memory). Median of --reps.

    .venv/bin/python benchmarks/bench_fingerprint.py [--size-gb 3] [--dir /tmp]
    .venv/bin/python benchmarks/bench_fingerprint.py --lora-only   # 4 and 5
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import sys
import tempfile
import time

import blake3

from vllm_kvbm import fingerprints as fp

CHUNK = 16 << 20
GB = 1e9


def _read_chunks(path, update):
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            update(view[:n])


def methods():
    auto = blake3.blake3.AUTO
    return {
        "blake3 mmap, all cores (used)": lambda p: fp.hash_file(p),
        "blake3 mmap, 1 thread": lambda p: blake3.blake3().update_mmap(p).hexdigest(),
        "blake3 read 16 MiB, all cores": lambda p: _hash_read(p, blake3.blake3(max_threads=auto)),
        "blake3 read 16 MiB, 1 thread": lambda p: _hash_read(p, blake3.blake3()),
        "sha256 read 16 MiB": lambda p: _hash_read(p, hashlib.sha256()),
        "read only, no hash": lambda p: _read_chunks(p, lambda v: None),
    }


def _hash_read(path, h):
    _read_chunks(path, h.update)
    return h.hexdigest()


def drop_cached(path):
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def make_file(directory, size):
    fd, path = tempfile.mkstemp(dir=directory, prefix="kvbm-fp-bench-", suffix=".safetensors")
    block = random.Random(0).randbytes(64 << 20)
    with os.fdopen(fd, "wb") as f:
        left = size
        while left:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())
    return path


def timed(fn, *args):
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def throughput(path, size, reps):
    rows = {}
    for name, fn in methods().items():
        warm, cold = [], []
        fn(path)  # into the page cache
        for _ in range(reps):
            warm.append(timed(fn, path))
        for _ in range(reps):
            drop_cached(path)
            cold.append(timed(fn, path))
        rows[name] = (size / statistics.median(warm) / GB, size / statistics.median(cold) / GB)
    return rows


def startup(model):
    with tempfile.TemporaryDirectory() as cache:
        os.environ["KVBM_CACHE_DIR"] = cache
        fp.clear_memory_cache()
        for name in os.listdir(model):
            drop_cached(os.path.join(model, name))  # as after a reboot
        first = timed(fp.model_fingerprint, model)
        fp.clear_memory_cache()
        cached = timed(fp.model_fingerprint, model)
        entries = len(
            [n for n in os.listdir(os.path.join(cache, "fingerprints")) if n.endswith(".json")]
        )
    del os.environ["KVBM_CACHE_DIR"]
    size = sum(os.path.getsize(os.path.join(model, n)) for n in os.listdir(model) if fp.counts(n))
    return size, first, cached, entries


def lora_per_request(directory, calls=20000):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump({"r": 8, "lora_alpha": 16, "target_modules": ["k_proj"]}, f)
    with open(os.path.join(directory, "adapter_model.safetensors"), "wb") as f:
        f.write(random.Random(1).randbytes(4 << 20))
    past = time.time_ns() - 10 * fp.RACY_NS  # as an adapter saved a while ago
    for name in os.listdir(directory):
        os.utime(os.path.join(directory, name), ns=(past, past))
    saved_racy, fp.RACY_NS = fp.RACY_NS, -(1 << 62)  # utime moved ctime to now
    try:
        fp.adapter_fingerprint(directory)
        start = time.perf_counter()
        for _ in range(calls):
            fp.adapter_fingerprint(directory)
        per_call = (time.perf_counter() - start) / calls
        start = time.perf_counter()
        for _ in range(calls):
            fp._dir_stat(directory)
        per_stat = (time.perf_counter() - start) / calls
    finally:
        fp.RACY_NS = saved_racy
    return per_call, per_stat


def lora_loads_cost(directory, size_mb, reps):
    """Seconds lora_loads.loaded() takes: (first on the host, another
    process, the same process), medians of ``reps``."""
    from vllm_kvbm.worker import lora_loads

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump({"r": 16, "lora_alpha": 32, "target_modules": ["k_proj"]}, f)
    with open(os.path.join(directory, "adapter_model.safetensors"), "wb") as f:
        rng = random.Random(2)
        for _ in range(size_mb):
            f.write(rng.randbytes(1 << 20))
    # Written a moment ago, the files' digests would not be cached (fingerprints.RACY_NS).
    time.sleep(fp.RACY_NS / 1e9 + 0.5)

    def once():
        return timed(lora_loads.loaded, 1, directory, fp.adapter_stat(directory))

    first, other, same = [], [], []
    for _ in range(reps):
        with tempfile.TemporaryDirectory() as cache:  # a host that never hashed it
            os.environ["KVBM_CACHE_DIR"] = cache
            fp.clear_memory_cache()
            first.append(once())
            fp.clear_memory_cache()  # another process: only the on-disk cache is shared
            other.append(once())
            same.append(once())
        del os.environ["KVBM_CACHE_DIR"]
    lora_loads.take_unreported()
    return statistics.median(first), statistics.median(other), statistics.median(same)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=3.0)
    parser.add_argument("--dir", default="/tmp")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--model", default="models/kvbm-llama-8l")
    parser.add_argument("--lora-mb", type=int, default=64)
    parser.add_argument("--lora-only", action="store_true", help="only the LoRA figures (4 and 5)")
    args = parser.parse_args()
    if args.lora_only:
        lora_figures(args)
        return
    if not os.path.isdir(args.model):
        sys.exit(
            f"--model {args.model} not found: build it with "
            ".venv/bin/python -m vllm_kvbm.tools.local_model"
        )

    print(f"cores: {os.cpu_count()}, blake3 {blake3.__version__}")
    size, first, cached, entries = startup(args.model)
    print(f"\nStartup on {args.model} ({size / 1e6:.1f} MB of config and weights):")
    print(f"  empty digest cache, files not in the page cache:{first * 1e3:8.1f} ms")
    print(
        f"  filled digest cache ({entries} entr{'y' if entries == 1 else 'ies'}):"
        f"         {cached * 1e3:8.2f} ms"
    )

    size = int(args.size_gb * (1 << 30))
    path = make_file(args.dir, size)
    try:
        rows = throughput(path, size, args.reps)
    finally:
        os.unlink(path)
    print(
        f"\nThroughput on one {size / GB:.2f} GB file under {args.dir} "
        f"(median of {args.reps}; cold = its cached pages dropped first):"
    )
    print(f"  {'method':34s} {'warm GB/s':>10s} {'cold GB/s':>10s}")
    for name, (warm, cold) in rows.items():
        print(f"  {name:34s} {warm:10.2f} {cold:10.2f}")

    used = "blake3 mmap, all cores (used)"
    warm, cold = rows[used]
    one_thread = rows["blake3 mmap, 1 thread"][0]
    print("\nA 70B checkpoint (140 GB), first start on a host (later starts read the cache):")
    print(f"  at this host's warm rate ({warm:.2f} GB/s): {140 / warm:7.0f} s")
    print(f"  at this host's cold rate ({cold:.2f} GB/s): {140 / cold:7.0f} s")
    for nvme in (3.5, 7.0, 14.0):
        cores = nvme / one_thread
        print(
            f"  at NVMe {nvme:4.1f} GB/s: {140 / nvme:7.0f} s (hashing keeps up with "
            f"{cores:.1f}+ cores at this host's {one_thread:.2f} GB/s per core)"
        )

    lora_figures(args)


def lora_figures(args):
    with tempfile.TemporaryDirectory() as tmp:
        per_call, per_stat = lora_per_request(os.path.join(tmp, "lora"))
        first, other, same = lora_loads_cost(
            os.path.join(tmp, "lora-load"), args.lora_mb, args.reps
        )
    print("\nLoRA adapter (2 files), per new request once its fingerprint is known:")
    print(
        f"  adapter_fingerprint: {per_call * 1e6:6.1f} us   (of which the stat of its "
        f"files: {per_stat * 1e6:.1f} us)"
    )
    print(
        f"\nWorker, per adapter load by vLLM ({args.lora_mb} MiB adapter in the page cache, "
        f"median of {args.reps}):"
    )
    print(f"  first on the host (files hashed): {first * 1e3:8.2f} ms")
    print(f"  another process (on-disk digest): {other * 1e3:8.2f} ms")
    print(f"  same process (digest in memory):  {same * 1e3:8.2f} ms")


if __name__ == "__main__":
    main()
