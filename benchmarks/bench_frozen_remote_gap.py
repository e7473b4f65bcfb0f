"""The decoding request's longest gap between tokens with a frozen remote
server, in the offline engine and in `vllm serve`, against no remote tier.

One request decodes (``ignore_eos``) while a fresh prompt of 1200 tokens
arrives every 10 of its tokens (every 10 engine steps), 6 of them. Each
front-end runs the workload twice on engines alike but for the remote tier:
without one, and with ``remote_url`` on a real LMCache server (127.0.0.1)
that is SIGSTOPped before the engine starts (it accepts connections and
never answers; ``remote_timeout_s`` 2 s). Every newcomer's lookup then waits
on the frozen server. Printed per front-end: the decoder's gaps from the
first newcomer sent until 10 tokens after the last newcomer's first token
(mean, longest), and the ratio of the longest gaps, frozen / no remote tier
(without the connector each newcomer is prefilled in a step of its own: the
longest gap is about one newcomer's prefill). The offline engine is
``LLMEngine`` driven by ``step()`` in a process of its own; the server's
decoder is streamed (chunks of one token each).

    .venv/bin/python benchmarks/bench_frozen_remote_gap.py [--newcomers 6] [--only offline|serve]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import random
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_frozen_remote import Stream, stream  # noqa: E402  (the server's token stream)

BLOCK_SIZE = 128
KINDS = ("no remote tier", "frozen remote")


def engine_args(args) -> dict:
    from vllm_kvbm.tools.compute_dtype import compute_dtype

    return dict(
        dtype=compute_dtype(),
        max_model_len=8192,
        max_num_batched_tokens=8192,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=True,
        enforce_eager=True,
        gpu_memory_utilization=0.25,
        kv_cache_memory_bytes=1 << 30,
    )


def prompts(args) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(7)
    decoder = [rng.randrange(10, 7000) for _ in range(32)]
    return decoder, [
        [rng.randrange(10, 7000) for _ in range(args.newcomer_tokens)]
        for _ in range(args.newcomers)
    ]


def gaps_of(stamps: list[float], start: float, end: float) -> list[float]:
    return [b - a for a, b in zip(stamps, stamps[1:]) if start <= b <= end]


def said(front: str, kind: str, r: dict) -> None:
    """Each run's figures as it ends (a long run keeps what it measured)."""
    gaps = gaps_of(r["stamps"], r["start"], r["end"])
    print(
        f"{front}, {kind}: {len(gaps)} gaps, mean {statistics.fmean(gaps) * 1e3:.0f} ms, "
        f"longest {max(gaps) * 1e3:.0f} ms",
        file=sys.stderr,
        flush=True,
    )


def offline_run(model: str, kv: dict, args, results) -> None:
    """The workload on an offline engine (a process of its own, so that each
    engine is gone with it): the decoder's token times and the window."""
    from vllm import EngineArgs, LLMEngine, SamplingParams
    from vllm.inputs import TokensPrompt

    engine = LLMEngine.from_engine_args(
        EngineArgs(model=model, kv_transfer_config=kv, **engine_args(args))
    )
    decoder, newcomers = prompts(args)
    engine.add_request(
        "decoder",
        TokensPrompt(prompt_token_ids=decoder),
        SamplingParams(max_tokens=4000, ignore_eos=True, temperature=0),
    )
    stamps, firsts, sent, start, end_at = [], {}, 0, None, None
    next_at = args.warmup
    while end_at is None or len(stamps) < end_at:
        if sent < len(newcomers) and len(stamps) >= next_at:
            start = start or time.perf_counter()
            engine.add_request(
                f"new{sent}",
                TokensPrompt(prompt_token_ids=newcomers[sent]),
                SamplingParams(max_tokens=4, ignore_eos=True, temperature=0),
            )
            sent += 1
            next_at = len(stamps) + args.every
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            n = len(out.outputs[0].token_ids)
            if out.request_id == "decoder":
                stamps += [now] * (n - len(stamps))
            elif n and out.request_id not in firsts:
                firsts[out.request_id] = now
        if end_at is None and len(firsts) == len(newcomers):
            end_at = len(stamps) + args.every
    results.put(
        {
            "stamps": stamps,
            "start": start,
            "end": now,
            "firsts_per_step": max(
                sum(t == f for f in firsts.values()) for t in set(firsts.values())
            ),
        }
    )
    engine.engine_core.shutdown()  # its engine-core process would outlive this one


async def serve_workload(server, args) -> dict:
    from vllm_kvbm.tools.completions import async_client

    decoder_prompt, newcomers = prompts(args)
    async with async_client(server.url, args.request_timeout) as client:
        decoder = Stream(time.perf_counter())
        task = asyncio.create_task(
            stream(client, server.model, decoder_prompt, 4000, decoder, args.request_timeout)
        )
        sent, start = [], None
        try:
            for prompt in newcomers:
                want = len(decoder.stamps) + (args.every if sent else args.warmup)
                while len(decoder.stamps) < want:
                    if task.done():
                        raise RuntimeError(f"the decoder ended early: {task}")
                    await asyncio.sleep(0.002)
                start = start or time.perf_counter()
                s = Stream(time.perf_counter())
                sent.append(
                    (
                        s,
                        asyncio.create_task(
                            stream(client, server.model, prompt, 4, s, args.request_timeout)
                        ),
                    )
                )
            await asyncio.gather(*(t for _, t in sent))
            want = len(decoder.stamps) + args.every
            while len(decoder.stamps) < want and not task.done():
                await asyncio.sleep(0.002)
            return {"stamps": list(decoder.stamps), "start": start, "end": time.perf_counter()}
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def with_frozen_server(kind: str, run):
    """Runs ``run(kv_extra)`` with the remote tier of ``kind``."""
    from vllm_kvbm.tools.server import free_port, freeze_process, start_lmcache_server, stop_process

    extra = {"host_cache_blocks": 64}
    if kind == "no remote tier":
        return run(extra)
    port = free_port()
    lm = start_lmcache_server(port)
    try:
        freeze_process(lm, "the lmcache server")
        return run({**extra, "remote_url": f"lm://127.0.0.1:{port}", "remote_timeout_s": 2.0})
    finally:
        lm.send_signal(signal.SIGCONT)
        stop_process(lm)


def offline(model: str, args) -> dict:
    from vllm_kvbm.tools.server import kvbm_transfer_config

    out = {}
    for kind in KINDS:

        def run(extra):
            ctx = multiprocessing.get_context("spawn")
            results = ctx.Queue()
            proc = ctx.Process(
                target=offline_run, args=(model, kvbm_transfer_config(**extra), args, results)
            )
            proc.start()
            try:
                return results.get(timeout=args.startup_timeout + args.request_timeout)
            finally:
                proc.join(60)
                if proc.is_alive():
                    proc.kill()

        out[kind] = with_frozen_server(kind, run)
        said("offline engine", kind, out[kind])
    return out


def serve(model: str, args) -> dict:
    from vllm_kvbm.tools.server import kvbm_transfer_config, vllm_server

    a = engine_args(args)
    serve_args = [
        "--enforce-eager",
        "--block-size",
        str(BLOCK_SIZE),
        "--dtype",
        a["dtype"],
        "--max-num-batched-tokens",
        str(a["max_num_batched_tokens"]),
        "--max-model-len",
        str(a["max_model_len"]),
        "--gpu-memory-utilization",
        "0.25",
        "--kv-cache-memory-bytes",
        str(a["kv_cache_memory_bytes"]),
    ]
    out = {}
    for kind in KINDS:

        def run(extra):
            with vllm_server(
                model,
                kvbm_transfer_config(**extra),
                serve_args,
                startup_timeout=args.startup_timeout,
            ) as server:
                return asyncio.run(serve_workload(server, args))

        out[kind] = with_frozen_server(kind, run)
        said("vllm serve", kind, out[kind])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--newcomers", type=int, default=6)
    parser.add_argument("--newcomer-tokens", type=int, default=1200)
    parser.add_argument(
        "--every", type=int, default=10, help="decoder tokens (engine steps) between newcomers"
    )
    parser.add_argument(
        "--warmup", type=int, default=20, help="decoder tokens before the first newcomer"
    )
    parser.add_argument("--only", choices=("offline", "serve"), default=None)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    if args.model is None:
        from vllm_kvbm.tools.local_model import DEFAULT_DIR, build

        args.model = str(build(DEFAULT_DIR))
    fronts = {"offline engine": offline, "vllm serve": serve}
    if args.only:
        fronts = {k: v for k, v in fronts.items() if args.only in k}
    runs = {name: front(args.model, args) for name, front in fronts.items()}

    print()
    print(
        f"1 request decoding; {args.newcomers} newcomers with fresh {args.newcomer_tokens}-token "
        f"prompts, one every {args.every} of its tokens; remote_timeout_s 2"
    )
    print("| front-end | remote tier | decoder gaps | mean | longest | longest / no remote tier |")
    print("|---|---|---:|---:|---:|---:|")
    ratios = {}
    for name, by_kind in runs.items():
        longest = {}
        for kind, r in by_kind.items():
            gaps = gaps_of(r["stamps"], r["start"], r["end"])
            longest[kind] = max(gaps)
            ratio = longest[kind] / longest[KINDS[0]]
            print(
                f"| {name} | {kind} | {len(gaps)} | {statistics.fmean(gaps) * 1e3:.0f} ms "
                f"| {max(gaps) * 1e3:.0f} ms | {ratio:.2f}x |"
            )
        ratios[name] = longest[KINDS[1]] / longest[KINDS[0]]
    print()
    for name, by_kind in runs.items():
        if "firsts_per_step" in by_kind[KINDS[1]]:
            print(
                f"{name}: most newcomers whose first token came in one step: "
                + ", ".join(f"{k} {r['firsts_per_step']}" for k, r in by_kind.items())
            )
    print(
        "decoder's longest gap, frozen remote / no remote tier: "
        + ", ".join(f"{name} {ratio:.2f}x" for name, ratio in ratios.items())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
