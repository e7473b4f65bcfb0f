"""TTFT of a hit from each tier next to recompute and vLLM's own prefix hit,
and each lower tier's bandwidth.

One engine with the host, disk and remote tiers (an LMCache server started
here on 127.0.0.1); for each prompt length its miss, then rounds of vLLM's
own hit, a host hit, and a disk hit with the page files in the page cache
and evicted from it (POSIX_FADV_DONTNEED: the disk tier then reads them
with O_DIRECT), then one remote hit; medians and ratios printed from one
run. The engine gets the cores vLLM gives an engine without a connector
(see bench_host_tier.py); they are read from its log and printed.

Bandwidth, before the engine starts: reads (``get_into``: read, checksum
verified, copied into a host slot) of the disk tier and of the remote tier on
an LMCache server (``lm://``), and on a Redis server (``redis-server`` on
127.0.0.1, as scripts/setup_tools.sh installs it): KVBM's RedisStore put and
get of pages against redis-py's plain SET and GET of the same bytes (the
stored pages) on the same server through the store's own client, the two
interleaved round by round, best round of each, ratios printed.

    .venv/bin/python benchmarks/bench_tiers.py [--tokens 2048 8192 16384] [--repeats 3] [--model PATH]
    .venv/bin/python benchmarks/bench_tiers.py --bandwidth-only [--page-mib 2 16]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

BLOCK_SIZE = 128


def ttft(llm, prompt) -> float:
    from vllm import SamplingParams

    start = time.perf_counter()
    llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(temperature=0.0, max_tokens=1),
        use_tqdm=False,
    )
    return time.perf_counter() - start


def reset(llm, **kwargs) -> None:
    """vLLM's ``reset_prefix_cache``, then a few one-token requests: a reset
    starts a weights epoch, and until every worker reported its weights in
    it (the next steps) KVBM loads host hits before the step rather than
    layer by layer, as within a few steps of any reset in a running server."""
    llm.reset_prefix_cache(**kwargs)
    for i in range(3):
        ttft(llm, [13 + i] * 16)
        time.sleep(0.05)


def drop_page_cache(paths) -> int:
    """Evicts ``paths`` from the page cache (clean pages: POSIX_FADV_DONTNEED,
    no privilege needed); the pages still cached after, where the kernel says
    (cachestat), else -1."""
    from vllm_kvbm.tiers.disk.file_io import _cached_pages

    left = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # written back first: dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            cached = _cached_pages(fd, os.fstat(fd).st_size)
            left = -1 if cached is None or left < 0 else left + cached
        finally:
            os.close(fd)
    return left


def warm_page_cache(paths) -> None:
    for path in paths:
        Path(path).read_bytes()


def tier_bandwidth(store, page_bytes: int, pages: int = 32, rounds: int = 3) -> float:
    """GB/s of get_into over ``pages`` stored pages, best of ``rounds``."""
    import torch

    keys = [os.urandom(32) for _ in range(pages)]
    page = torch.randint(0, 255, (page_bytes,), dtype=torch.uint8)
    for key in keys:
        store.put(key, page)
    time.sleep(1.0)  # writes behind the put (the lm:// store) land
    out = torch.empty(page_bytes, dtype=torch.uint8)
    best = 0.0
    for _ in range(rounds):
        start = time.perf_counter()
        ok = sum(store.get_into(key, out) == "ok" for key in keys)
        best = max(best, ok * page_bytes / (time.perf_counter() - start) / 1e9)
    return best


def start_redis(port: int, workdir: str, timeout: float = 20.0) -> subprocess.Popen:
    """A redis-server on 127.0.0.1 (no persistence, LRU), answering when this returns."""
    import redis

    if shutil.which("redis-server") is None:
        raise RuntimeError("redis-server not found: scripts/setup_tools.sh installs it")
    proc = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--maxmemory",
            "2gb",
            "--maxmemory-policy",
            "allkeys-lru",
            "--dir",
            workdir,
            "--daemonize",
            "no",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {proc.returncode}")
        try:
            with redis.Redis("127.0.0.1", port, socket_timeout=2) as c:
                if c.ping():
                    return proc
        except redis.RedisError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"redis-server not answering after {timeout}s")


def redis_bandwidth(
    url: str, page_bytes: int, total_bytes: int = 64 << 20, rounds: int = 9
) -> dict[str, float]:
    """GB/s of RedisStore.put/get_into and of redis-py's SET/GET of the same
    stored bytes through the store's own redis-py client, on one server;
    rounds interleaved, best of each."""
    import torch

    from vllm_kvbm.config import parse_remote_url
    from vllm_kvbm.tiers.redis.store import RedisStore

    n = max(4, total_bytes // page_bytes)
    store = RedisStore(parse_remote_url("remote_url", url), None, page_bytes, "bench", 0, 1)
    raw = store._link._client  # the store's own client: same connections, same settings
    try:
        keys = [os.urandom(32) for _ in range(n)]
        names = [store._page_name(k) for k in keys]
        page = torch.randint(0, 256, (page_bytes,), dtype=torch.uint8)
        out = torch.empty(page_bytes, dtype=torch.uint8)
        best = dict.fromkeys(("kvbm put", "raw set", "kvbm get", "raw get"), float("inf"))

        def timed(what: str, fn) -> None:
            start = time.perf_counter()
            fn()
            best[what] = min(best[what], time.perf_counter() - start)

        for _ in range(rounds):
            timed("kvbm put", lambda: all(store.put(k, page) for k in keys) or _fail("put"))
            stored = [raw.get(name) for name in names]  # the exact bytes KVBM stored
            timed(
                "raw set",
                lambda: [raw.set(b"raw:" + name.encode(), v) for name, v in zip(names, stored)],
            )
            timed(
                "kvbm get",
                lambda: all(store.get_into(k, out) == "ok" for k in keys) or _fail("get"),
            )
            timed("raw get", lambda: all(raw.get(name) is not None for name in names))
        # each reply is dropped as it comes, as get_into drops its own
        return {what: n * page_bytes / secs / 1e9 for what, secs in best.items()}
    finally:
        raw.flushdb()
        store.close()


def _fail(what: str) -> None:
    raise RuntimeError(f"a RedisStore {what} failed during the benchmark")


def bandwidth(page_mib: list[int]) -> dict:
    """Every lower tier's bandwidth (see the module's docstring)."""
    from vllm_kvbm.tiers.disk.store import DiskStore
    from vllm_kvbm.tiers.lm.store import RemoteStore
    from vllm_kvbm.tools.server import free_port, start_lmcache_server
    from vllm_kvbm.tools.server import stop_process as stop

    work = tempfile.mkdtemp(prefix="kvbm-bench-bw-")
    bw: dict = {"disk": {}, "lm": {}, "redis": {}}
    lm_port, redis_port = free_port(), free_port()
    lm_server = start_lmcache_server(lm_port)
    redis_server = start_redis(redis_port, work)
    try:
        for mib in page_mib:
            page = mib << 20
            disk_store = DiskStore(os.path.join(work, f"disk-{mib}"), 1 << 30, page, "bench", 0, 1)
            bw["disk"][mib] = tier_bandwidth(disk_store, page, max(4, 64 // mib))
            disk_store.close()
            shutil.rmtree(os.path.join(work, f"disk-{mib}"), ignore_errors=True)
            remote_store = RemoteStore(f"lm://127.0.0.1:{lm_port}", page, "bench", 0, 1)
            bw["lm"][mib] = tier_bandwidth(remote_store, page, max(4, 64 // mib))
            remote_store.close()
            bw["redis"][mib] = redis_bandwidth(f"redis://127.0.0.1:{redis_port}", page)
    finally:
        stop(lm_server)
        stop(redis_server)
        shutil.rmtree(work, ignore_errors=True)
    return bw


def report_bandwidth(bw: dict) -> None:
    print()
    print(
        "| tier | page | KVBM read | plain client read | read ratio | KVBM write "
        "| plain client write | write ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for mib, gbs in bw["disk"].items():
        print(f"| disk | {mib} MiB | {gbs:.2f} GB/s | | | | | |")
    for mib, gbs in bw["lm"].items():
        print(f"| remote, lm:// (LMCache server) | {mib} MiB | {gbs:.2f} GB/s | | | | | |")
    for mib, r in bw["redis"].items():
        print(
            f"| remote, redis:// (redis-server) | {mib} MiB | {r['kvbm get']:.2f} GB/s | "
            f"{r['raw get']:.2f} GB/s | {r['kvbm get'] / r['raw get']:.2f}x | "
            f"{r['kvbm put']:.2f} GB/s | {r['raw set']:.2f} GB/s | "
            f"{r['kvbm put'] / r['raw set']:.2f}x |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192])
    parser.add_argument("--repeats", type=int, default=3, help="rounds of each hit per length")
    parser.add_argument(
        "--bandwidth-only", action="store_true", help="only the lower tiers' bandwidth (no engine)"
    )
    parser.add_argument(
        "--page-mib",
        type=int,
        nargs="+",
        default=[2, 16],
        help="page sizes of the bandwidth table (2 MiB: one block of the local model)",
    )
    args = parser.parse_args()
    bw = bandwidth(args.page_mib)
    report_bandwidth(bw)
    if args.bandwidth_only:
        return
    if args.model is None:
        from vllm_kvbm.tools.local_model import DEFAULT_DIR, build

        args.model = str(build(DEFAULT_DIR))
    from vllm_kvbm.bench.cores import fair_cpu_env

    cpu_env = fair_cpu_env()
    os.environ.update(cpu_env)
    t, binding = measure(args)
    print()
    print(
        f"engine: {binding.describe() if binding else 'cores not read'}, "
        f"started with {' '.join(f'{k}={v}' for k, v in cpu_env.items())} "
        f"on {os.cpu_count()} cores"
    )
    report(args, t)


def measure(args) -> tuple[dict, object]:
    """The TTFTs of each path by prompt length ({tokens: {path: [seconds]}}),
    and the cores the engine ran on."""
    from vllm import LLM

    from vllm_kvbm.bench.cores import process_binding
    from vllm_kvbm.tools.compute_dtype import compute_dtype, describe
    from vllm_kvbm.tools.server import free_port, kvbm_transfer_config, start_lmcache_server
    from vllm_kvbm.tools.server import stop_process as stop

    port = free_port()
    server = start_lmcache_server(port)
    disk = Path(tempfile.mkdtemp(prefix="kvbm-bench-disk-"))
    longest = max(args.tokens)
    try:
        print(f"dtype: {describe()}", flush=True)
        llm = LLM(
            model=args.model,
            dtype=compute_dtype(),
            block_size=BLOCK_SIZE,
            enforce_eager=True,
            max_model_len=longest + BLOCK_SIZE,
            max_num_batched_tokens=8192,
            kv_cache_memory_bytes=max(1 << 30, (longest // BLOCK_SIZE + 16) * 4 << 20),
            gpu_memory_utilization=0.3,
            kv_transfer_config=kvbm_transfer_config(
                host_cache_blocks=longest // BLOCK_SIZE + 8,
                disk_cache_dir=str(disk),
                disk_cache_size="8GiB",
                remote_url=f"lm://127.0.0.1:{port}",
            ),
        )
        ttft(llm, [11] * 64)
        binding = process_binding(os.getpid())  # this process's engine core and its workers
        t = {n: _measure_prompt(llm, n, disk, args.repeats) for n in args.tokens}
        llm.llm_engine.engine_core.shutdown()
    finally:
        stop(server)
        shutil.rmtree(disk, ignore_errors=True)
    return t, binding


def _measure_prompt(llm, tokens: int, disk: Path, repeats: int) -> dict[str, list[float]]:
    """One prompt of ``tokens``: its miss, then ``repeats`` rounds of each hit
    in turn (vLLM's, the host tier's, the disk tier's with its files in the
    page cache and evicted from it), then the remote hit once. Between hits
    vLLM's prefix cache is reset, and with it the host tier (a connector
    reset) where the page must come from below."""
    rng = random.Random(tokens)
    prompt = [rng.randrange(10, 7000) for _ in range(tokens)]
    before = set(disk.glob("*.pt"))
    t: dict[str, list[float]] = {"miss": [ttft(llm, prompt)]}
    time.sleep(2.0)  # write-through to disk and the server lands
    files = sorted(set(disk.glob("*.pt")) - before)
    print(f"{tokens} tokens: miss {t['miss'][0]:.2f} s, {len(files)} disk pages", flush=True)
    for _ in range(repeats):
        t.setdefault("vLLM prefix hit", []).append(ttft(llm, prompt))
        reset(llm)
        t.setdefault("host hit", []).append(ttft(llm, prompt))
        warm_page_cache(files)
        reset(llm, reset_connector=True)
        t.setdefault("disk hit, page cache warm", []).append(ttft(llm, prompt))
        reset(llm, reset_connector=True)
        left = drop_page_cache(files)
        if left:
            print(f"  {left} pages of the prompt's disk files still cached", flush=True)
        t.setdefault("disk hit, page cache cold", []).append(ttft(llm, prompt))
    reset(llm, reset_connector=True)
    for path in files:
        path.unlink()  # only the server has the prompt now
    t["remote hit"] = [ttft(llm, prompt)]
    return t


def report(args, t: dict) -> None:
    """Per prompt length: each path's median TTFT, and the ratios the copy
    goals are read from."""
    from statistics import median

    print()
    print(f"medians of {args.repeats} rounds (miss and remote hit: one each)")
    for tokens, paths in t.items():
        m = {name: median(times) for name, times in paths.items()}
        print()
        print(f"prompt: {tokens} tokens, {tokens // BLOCK_SIZE} blocks")
        print("| path | TTFT | miss / this | rounds |")
        print("|---|---:|---:|---|")
        for name, seconds in m.items():
            rounds = ", ".join(f"{x * 1000:.0f}" for x in paths[name])
            print(f"| {name} | {seconds * 1000:.0f} ms | {m['miss'] / seconds:.1f}x | {rounds} |")
        host = m["host hit"]
        print(
            f"host hit / vLLM hit {host / m['vLLM prefix hit']:.3f}x; disk hit / host hit "
            f"{m['disk hit, page cache warm'] / host:.3f}x (page cache warm), "
            f"{m['disk hit, page cache cold'] / host:.3f}x (cold)"
        )


if __name__ == "__main__":
    main()
