"""Decode latency of running requests while the remote (lm://) server is frozen.

A real LMCache server and a real `vllm serve` with the KVBM connector (remote
tier on that server, ``remote_timeout_s`` 2 s), both on 127.0.0.1. In each
phase a few streamed requests decode (``ignore_eos``) while newcomers with
fresh prompts of a few blocks arrive; KVBM asks the server about each
newcomer's blocks (a remote lookup, EXIST) before vLLM admits it.

- healthy: the server answers.
- frozen: the server is SIGSTOPped before the first newcomer is sent and
  SIGCONTed at the end of the window.

The phases alternate (healthy, frozen, ..., healthy), so that other work on
the machine hits both kinds alike. Printed: the inter-token latency (ITL, the
gaps between streamed chunks; chunks holding more than one token are counted)
of the decoding requests over each phase's window (from the first newcomer
sent, of one length in all phases, holding every newcomer's prefill), mean /
p50 / p99 / max per phase and over each kind, the ratio frozen / healthy, and
each newcomer's TTFT. A lookup on vLLM's
scheduler thread would add up to ``remote_timeout_s`` to the step it ran in
(there is no switch back to that: the gaps of at least the timeout are
counted instead).

    .venv/bin/python benchmarks/bench_frozen_remote.py [--decoders 2] [--newcomers 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import sys
import time
from functools import partial

import numpy as np

from vllm_kvbm.tools.completions import Streamed as Stream
from vllm_kvbm.tools.completions import async_client, stream_into

# each chunk's token count (return_token_ids): a chunk of several tokens is one gap
stream = partial(stream_into, token_ids=True)

BLOCK_SIZE = 128


def gaps_within(streams: list[Stream], start: float, end: float) -> list[float]:
    """Gaps between consecutive chunks of each stream whose later chunk
    arrived in [start, end]."""
    out = []
    for s in streams:
        out += [b - a for a, b in zip(s.stamps, s.stamps[1:]) if start <= b <= end]
    return out


async def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout:.0f} s: {what}")
        await asyncio.sleep(0.05)


async def phase(url: str, model: str, args, rng: random.Random, freeze=None, thaw=None) -> dict:
    """Decoders stream; newcomers arrive every ``args.gap`` s. Returns the
    decoders' gaps over the window (from the first newcomer sent, ``args.window``
    seconds or until the last newcomer finished) and the newcomers' TTFTs."""
    async with async_client(url, args.request_timeout) as client:
        decoders = [Stream(time.perf_counter()) for _ in range(args.decoders)]
        tasks = [
            asyncio.create_task(
                stream(
                    client,
                    model,
                    [rng.randrange(10, 7000) for _ in range(32)],
                    args.decode_tokens,
                    d,
                    args.request_timeout,
                )
            )
            for d in decoders
        ]
        try:
            await wait_until(
                lambda: all(len(d.stamps) >= 8 for d in decoders) or any(t.done() for t in tasks),
                120,
                "decoders streaming",
            )
            if any(t.done() for t in tasks):
                raise RuntimeError(f"a decoder ended early: {[t for t in tasks if t.done()]}")
            quiet_from = time.perf_counter()
            await asyncio.sleep(1.0)
            quiet = gaps_within(decoders, quiet_from, time.perf_counter())
            if freeze is not None:
                freeze()
            start = time.perf_counter()
            newcomers: list[Stream] = []
            sent = []
            try:
                for i in range(args.newcomers):
                    if i:
                        await asyncio.sleep(args.gap)
                    s = Stream(time.perf_counter())
                    newcomers.append(s)
                    prompt = [
                        rng.randrange(10, 7000)
                        for _ in range(args.newcomer_blocks * BLOCK_SIZE + 1)
                    ]
                    sent.append(
                        asyncio.create_task(
                            stream(
                                client, model, prompt, args.newcomer_tokens, s, args.request_timeout
                            )
                        )
                    )
                done, _ = await asyncio.wait(sent, timeout=args.request_timeout)
                # A window of one length in every phase, so that each holds
                # the same prefills and the mean ITLs compare.
                await asyncio.sleep(max(0.0, start + args.window - time.perf_counter()))
                end = time.perf_counter()
            finally:
                if thaw is not None:
                    thaw()
            for t in sent:
                if t not in done or t.exception() is not None:
                    raise RuntimeError(
                        f"a newcomer failed: {t.exception() if t in done else 'timeout'}"
                    )
            if any(t.done() for t in tasks):
                raise RuntimeError("a decoder finished inside the window: raise --decode-tokens")
            chunky = sum(n > 1 for d in decoders for n in d.tokens)
            # the longest gap, and when in the window it began
            longest = max(
                (b - a, a - start)
                for d in decoders
                for a, b in zip(d.stamps, d.stamps[1:])
                if start <= b <= end
            )
            return {
                "gaps": gaps_within(decoders, start, end),
                "quiet": quiet,
                "ttft": [s.ttft for s in newcomers],
                "window": end - start,
                "first_token_at": [s.stamps[0] - start for s in newcomers],
                "longest": longest,
                "multi_token_chunks": chunky,
                "wall_start": time.time() - (time.perf_counter() - start),
            }
        finally:
            for t in tasks:
                t.cancel()  # closes the stream: vLLM aborts the request
            await asyncio.gather(*tasks, return_exceptions=True)


def row(name: str, gaps: list[float], ref: list[float] | None) -> str:
    mean = statistics.fmean(gaps)
    ratio = f"{mean / statistics.fmean(ref):.2f}x" if ref else "1.00x"
    p50, p99 = np.percentile(gaps, [50, 99])
    return (
        f"| {name} | {len(gaps)} | {mean * 1e3:.1f} ms | {p50 * 1e3:.1f} ms "
        f"| {p99 * 1e3:.1f} ms | {max(gaps) * 1e3:.1f} ms | {ratio} |"
    )


def main(argv: list[str] | None = None) -> int:
    from vllm_kvbm.tools.server import free_port, kvbm_transfer_config, vllm_server
    from vllm_kvbm.bench.cores import process_binding
    from vllm_kvbm.tools.server import freeze_process, start_lmcache_server, stop_process

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--decoders", type=int, default=2, help="requests decoding meanwhile")
    parser.add_argument(
        "--decode-tokens",
        type=int,
        default=3000,
        help="their max_tokens (they are cancelled after the window)",
    )
    parser.add_argument("--newcomers", type=int, default=8, help="new requests per phase")
    parser.add_argument(
        "--newcomer-blocks",
        type=int,
        default=4,
        help="their prompt length in blocks of 128 tokens (+1 token)",
    )
    parser.add_argument("--newcomer-tokens", type=int, default=8)
    parser.add_argument("--gap", type=float, default=0.7, help="seconds between newcomers")
    parser.add_argument(
        "--window",
        type=float,
        default=None,
        help="seconds measured per phase (default: the newcomers' arrivals "
        "+ 2 remote timeouts + 3 s)",
    )
    parser.add_argument(
        "--batch-tokens",
        type=int,
        default=None,
        help="--max-num-batched-tokens (default: one newcomer's prompt + 128, "
        "so newcomers released together prefill in separate steps)",
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="frozen phases, each between two healthy ones"
    )
    parser.add_argument("--settle", type=float, default=3.0, help="seconds between phases")
    parser.add_argument("--remote-timeout", type=float, default=2.0, help="remote_timeout_s")
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    if args.window is None:
        args.window = (args.newcomers - 1) * args.gap + 2 * args.remote_timeout + 3
    if args.model is None:
        from vllm_kvbm.tools.local_model import DEFAULT_DIR, build

        args.model = str(build(DEFAULT_DIR))

    max_len = max(
        4096,
        args.newcomer_blocks * BLOCK_SIZE + args.newcomer_tokens + 256,
        args.decode_tokens + 64,
    )
    blocks = (
        args.decoders * (args.decode_tokens + 64)
        + args.newcomers * (args.newcomer_blocks + 1) * BLOCK_SIZE
    ) // BLOCK_SIZE + 16
    batch = args.batch_tokens or (args.newcomer_blocks + 1) * BLOCK_SIZE
    serve_args = [
        "--enforce-eager",
        "--block-size",
        str(BLOCK_SIZE),
        "--max-num-batched-tokens",
        str(batch),
        "--max-model-len",
        str(max_len),
        "--gpu-memory-utilization",
        "0.25",
        "--num-gpu-blocks-override",
        str(blocks),
    ]
    env = {"VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1")}
    port = free_port()
    lm = start_lmcache_server(port)
    phases: list[tuple[str, dict]] = []
    try:
        kv = kvbm_transfer_config(
            host_cache_blocks=4 * args.newcomers * args.newcomer_blocks,
            remote_url=f"lm://127.0.0.1:{port}",
            remote_timeout_s=args.remote_timeout,
        )
        with vllm_server(
            args.model, kv, serve_args, env=env, startup_timeout=args.startup_timeout
        ) as server:
            rng = random.Random(12)

            def freeze():
                freeze_process(lm, "the lmcache server")

            def thaw():
                lm.send_signal(signal.SIGCONT)

            # Interleaved, so that other work on the machine hits both kinds
            # alike; after an unmeasured round that warms the engine up.
            order = ["warm-up"] + ["healthy", "frozen"] * args.rounds + ["healthy"]
            for i, name in enumerate(order):
                hooks = {"freeze": freeze, "thaw": thaw} if name == "frozen" else {}
                before = server.metric("kvbm_lookup_tokens_total")
                r = asyncio.run(phase(server.url, server.model, args, rng, **hooks))
                r["looked_up"] = server.metric("kvbm_lookup_tokens_total") - before
                phases.append((name, r))
                print(
                    f"{i}/{len(order) - 1} {name}: window {r['window']:.1f} s from unix "
                    f"{r['wall_start']:.3f}, longest gap "
                    f"{r['longest'][0]:.2f} s from +{r['longest'][1]:.2f} s; newcomers' first "
                    "tokens at +" + ", ".join(f"{t:.2f}" for t in r["first_token_at"]) + " s",
                    file=sys.stderr,
                    flush=True,
                )
                time.sleep(args.settle)  # the thawed server answers its backlog
            del phases[0]  # the warm-up
            log = server.log_path.read_text(errors="replace")
            binding = process_binding(server.process.pid)
    finally:
        lm.send_signal(signal.SIGCONT)
        stop_process(lm)

    def gaps(kind: str, key: str = "gaps") -> list[float]:
        return [g for name, r in phases if name == kind for g in r[key]]

    healthy, frozen = gaps("healthy"), gaps("frozen")
    print()
    print(
        f"{args.decoders} requests decoding; per phase {args.newcomers} newcomers with "
        f"{args.newcomer_blocks * BLOCK_SIZE + 1}-token fresh prompts, one every {args.gap} s; "
        f"remote_timeout_s {args.remote_timeout}; {args.rounds} frozen phases between "
        f"{args.rounds + 1} healthy ones"
    )
    print("| decoders' ITL | gaps | mean | p50 | p99 | max | mean / healthy |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    print(
        row(
            "no newcomers (1 s before each window)",
            gaps("healthy", "quiet") + gaps("frozen", "quiet"),
            healthy,
        )
    )
    print(row("**healthy** (all)", healthy, None))
    print(row("**frozen** (all)", frozen, healthy))
    for i, (name, r) in enumerate(phases):
        print(row(f"{i + 1}. {name}", r["gaps"], healthy))
    print()
    print("| phase | newcomer TTFT, s, in arrival order | tokens looked up |")
    print("|---|---|---:|")
    for i, (name, r) in enumerate(phases):
        print(
            f"| {i + 1}. {name} | {', '.join(f'{t:.2f}' for t in r['ttft'])} "
            f"| {r['looked_up']:.0f} |"
        )
    chunky = sum(r["multi_token_chunks"] for _, r in phases)
    slow = [sum(g >= args.remote_timeout for g in gs) for gs in (healthy, frozen)]
    print()
    mean = statistics.fmean(frozen) / statistics.fmean(healthy)
    print(
        f"ITL frozen / healthy: mean {mean:.2f}x, "
        f"p50 {np.percentile(frozen, 50) / np.percentile(healthy, 50):.2f}x, "
        f"p99 {np.percentile(frozen, 99) / np.percentile(healthy, 99):.2f}x, "
        f"max {max(frozen) / max(healthy):.2f}x"
    )
    # Healthy newcomers are misses (fresh prompts): their TTFT is the recompute's.
    ttfts = {
        kind: [t for name, r in phases if name == kind for t in r["ttft"]]
        for kind in ("healthy", "frozen")
    }
    recompute = statistics.fmean(ttfts["healthy"])
    print(
        f"newcomers' TTFT frozen / recompute (healthy newcomers' mean, {recompute:.3f} s): "
        f"mean {statistics.fmean(ttfts['frozen']) / recompute:.2f}x, "
        f"worst {max(ttfts['frozen']) / recompute:.2f}x "
        f"(healthy newcomers' worst: {max(ttfts['healthy']) / recompute:.2f}x)"
    )
    print(
        f"gaps >= remote_timeout_s ({args.remote_timeout} s, what one lookup on the scheduler "
        f"thread would add to its step): healthy {slow[0]}, frozen {slow[1]}"
    )
    print(
        f"decoder chunks holding more than one token: {chunky}; engine on "
        f"{binding.describe() if binding else 'cores not read'}"
    )
    print(
        "engine log: remote tier unavailable for lookups: "
        f"{'unavailable for lookups' in log}, reachable again: {'reachable again' in log}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
