"""Soak test: many concurrent streaming requests with shared prefixes, checked token by token.

Starts ``vllm serve`` with KVBMConnector, an engine KV cache and a host tier
both far too small for the workload (so vLLM preempts, the host tier evicts
and onboards constantly), sends concurrent greedy streaming completions whose
prompts are one of a few shared "documents" plus a distinct suffix (some
requests repeat exactly), and requires

* every output to equal the same prompt run alone on a plain engine (no
  connector, float32, eager, same block size) that recomputed everything;
* no request to hang (a per-request timeout and an overall deadline);
* the host tier to have evicted and onboarded blocks, with no load errors.

With ``--reset-every S`` the prefix caches are reset under the traffic every S
seconds (``POST /reset_prefix_cache``, cycling through running requests kept
or preempted and the connector's tiers kept or cleared, as an RLHF weight
update or a benchmark harness does; a refused reset is tried again a few
times within a second, as such a caller would); at least one reset must
succeed mid-run, and after the run a reset of every cache must leave nothing
to onboard.

    .venv/bin/python benchmarks/soak.py [--requests 200] [--concurrency 16]
        [--duration-limit 1200] [--reset-every 3] [--model PATH] [--no-kvbm]

``--no-kvbm`` runs the same workload against a plain server (the control: it
shows whether a mismatch comes from the connector or from batching numerics).
Exit status 0 when every check passes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from soak_report import _settle, check, summary

BLOCK_SIZE = 128


@dataclass
class SoakConfig:
    requests: int = 200
    concurrency: int = 16
    duration_limit: float = 1200.0  # overall deadline for the request phase, seconds
    request_timeout: float = 300.0  # per request, seconds
    doc_lengths: tuple[int, ...] = (1100, 2000, 2900)
    suffix_range: tuple[int, int] = (8, 300)
    repeat_fraction: float = 0.25  # share of requests that repeat an earlier prompt
    max_tokens: int = 12
    one_token_fraction: float = 0.1  # requests with max_tokens=1
    cancel_fraction: float = 0.1  # requests the client abandons
    cancel_within: float = 20.0  # ... after a uniform delay up to this, seconds
    # Both tiers evict constantly. The host tier holds more blocks than the
    # engine: it only serves blocks the engine's own prefix cache has lost,
    # and a host tier smaller than the engine cache mostly holds a subset of
    # it (measured: 40 engine / 24 host blocks onboard ~10 blocks per 50
    # requests, 28 / 40 onboard ~200).
    engine_blocks: int = 28  # --num-gpu-blocks-override
    host_blocks: int = 40  # host_cache_blocks
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 16
    # Admit requests whose whole prompt does not fit yet: prefills then preempt
    # each other mid-prompt, with their stores in flight.
    overadmit: bool = True
    seed: int = 0
    kvbm: bool = True
    idle_timeout: float = 60.0  # for the engine to drain after the last request
    reset_every: float = 0.0  # seconds between cache resets under traffic; 0: none


@dataclass
class SoakRequest:
    prompt: list[int]
    max_tokens: int
    # the client disconnects after this many seconds (an abort at a random
    # point: queued, loading, prefilling or decoding); its output is not checked
    cancel_after: float | None = None


def make_workload(cfg: SoakConfig) -> list[SoakRequest]:
    """``cfg.requests`` requests: a shared document plus a distinct suffix; some
    repeat an earlier prompt exactly, a few stop after one token (they finish in
    the step that stores their last prompt blocks) and a few are cancelled."""
    rng = random.Random(cfg.seed)
    docs = [[rng.randrange(10, 7000) for _ in range(n)] for n in cfg.doc_lengths]
    prompts: list[list[int]] = []
    reqs: list[SoakRequest] = []
    for _ in range(cfg.requests):
        if prompts and rng.random() < cfg.repeat_fraction:
            prompt = list(rng.choice(prompts))
        else:
            doc = rng.choice(docs)
            n = rng.randint(*cfg.suffix_range)
            if rng.random() < 0.5:
                # End exactly on, just past or just short of a block boundary:
                # the lookup's "leave one token" edge, and decode crossing into
                # a new block (which preempts when the engine cache is full).
                target = rng.choice((0, 1, BLOCK_SIZE - cfg.max_tokens // 2, BLOCK_SIZE - 1))
                n += (target - (len(doc) + n)) % BLOCK_SIZE
            prompt = doc + [rng.randrange(10, 7000) for _ in range(n)]
            prompts.append(prompt)
        max_tokens = 1 if rng.random() < cfg.one_token_fraction else cfg.max_tokens
        cancel = rng.uniform(0.0, cfg.cancel_within) if rng.random() < cfg.cancel_fraction else None
        reqs.append(SoakRequest(prompt, max_tokens, cancel))
    return reqs


@dataclass
class SoakResult:
    requests: list[SoakRequest]
    outputs: list[list[int] | None]  # None: failed, hung or cancelled
    latencies: list[float]
    errors: dict[int, str]  # request index -> what went wrong
    cancelled: set[int]
    wall_s: float
    counters: dict[str, float] = field(default_factory=dict)
    mismatches: list[int] = field(default_factory=list)
    not_idle: str = ""  # what the engine still held after the run
    # (query, outcome) of each reset under traffic: "ok", "refused" (vLLM
    # said success=false: blocks still held) or the HTTP error
    resets: list[tuple[str, str]] = field(default_factory=list)
    # after the run, every cache reset: what the repeated prompt still found
    after_reset: str = ""


def serve_args(cfg: SoakConfig) -> list[str]:
    return [
        "--dtype",
        "float32",
        "--enforce-eager",
        "--block-size",
        str(BLOCK_SIZE),
        "--num-gpu-blocks-override",
        str(cfg.engine_blocks),
        "--max-model-len",
        str(min(4096, (cfg.engine_blocks - 1) * BLOCK_SIZE)),
        "--max-num-batched-tokens",
        str(cfg.max_num_batched_tokens),
        "--max-num-seqs",
        str(cfg.max_num_seqs),
        "--gpu-memory-utilization",
        "0.25",
        "--seed",
        "0",
        *(["--no-scheduler-reserve-full-isl"] if cfg.overadmit else []),
    ]


def reference_outputs(
    prompts: list[list[int]], max_tokens: int, llm=None, model: str | None = None
) -> dict[tuple[int, ...], list[int]]:
    """Greedy outputs (``max_tokens`` each) of every distinct prompt, run alone on
    a plain engine that recomputes everything: its prefix cache is reset before
    each prompt. Shorter requests must produce a prefix of these."""
    from vllm import LLM, SamplingParams

    own = llm is None
    if own:
        llm = LLM(
            model=model,
            dtype="float32",
            enforce_eager=True,
            block_size=BLOCK_SIZE,
            max_model_len=4096,
            max_num_batched_tokens=4096,
            seed=0,
            gpu_memory_utilization=0.25,
            kv_cache_memory_bytes=512 << 20,
        )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    want: dict[tuple[int, ...], list[int]] = {}
    try:
        for p in prompts:
            key = tuple(p)
            if key in want:
                continue
            llm.reset_prefix_cache()
            out = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
            want[key] = list(out[0].outputs[0].token_ids)
    finally:
        if own:
            llm.llm_engine.engine_core.shutdown()
    return want


async def _one(
    link: "Link", model: str, req: SoakRequest, timeout: float
) -> tuple[list[int], float]:
    from vllm_kvbm.tools.completions import stream

    out = await stream(link.client, model, req.prompt, req.max_tokens, timeout, token_ids=True)
    return out.token_ids, out.total


@dataclass
class Link:
    """The openai client the completions go through, and its HTTP client
    (the resets: not an OpenAI route)."""

    client: object
    http: object


@contextlib.asynccontextmanager
async def _link(url: str, timeout: float):
    from openai import DefaultAsyncHttpxClient

    from vllm_kvbm.tools.completions import async_client

    http = DefaultAsyncHttpxClient()
    async with async_client(url, timeout, http_client=http) as client:
        yield Link(client, http)


async def _run_requests(
    url: str, model: str, reqs: list[SoakRequest], cfg: SoakConfig
) -> SoakResult:
    from openai import APITimeoutError

    result = SoakResult(reqs, [None] * len(reqs), [0.0] * len(reqs), {}, set(), 0.0)
    sem = asyncio.Semaphore(cfg.concurrency)

    async def worker(link: Link, i: int) -> None:
        req = reqs[i]
        async with sem:
            task = asyncio.ensure_future(_one(link, model, req, cfg.request_timeout))
            # A cancelled request's client closes the connection: vLLM aborts it.
            done, _ = await asyncio.wait({task}, timeout=req.cancel_after)
            if task not in done:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                result.cancelled.add(i)
                return
            try:
                result.outputs[i], result.latencies[i] = task.result()
            except (asyncio.TimeoutError, APITimeoutError):
                result.errors[i] = f"no answer within {cfg.request_timeout:.0f} s (hang)"
            except Exception as err:  # noqa: BLE001 - every failure is reported
                result.errors[i] = f"{type(err).__name__}: {err}"

    start = time.perf_counter()
    async with _link(url, cfg.request_timeout) as link:
        tasks = [asyncio.ensure_future(worker(link, i)) for i in range(len(reqs))]
        resetter = (
            asyncio.ensure_future(_reset_loop(link, url, cfg, result))
            if cfg.reset_every > 0
            else None
        )
        _, pending = await asyncio.wait(tasks, timeout=cfg.duration_limit)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if resetter is not None:
            resetter.cancel()
            await asyncio.gather(resetter, return_exceptions=True)
    for i, out in enumerate(result.outputs):
        if out is None and i not in result.errors and i not in result.cancelled:
            result.errors[i] = f"unfinished at the {cfg.duration_limit:.0f} s deadline (hang)"
    result.wall_s = time.perf_counter() - start
    return result


# Reset variants, in turn: running requests kept (refused while any holds
# blocks) or preempted, and the connector's tiers kept or cleared too.
RESET_QUERIES = (
    "reset_running_requests=true&reset_external=true",
    "reset_running_requests=false&reset_external=true",
    "reset_running_requests=true&reset_external=false",
    "reset_running_requests=false&reset_external=false",
)


# vLLM 0.32 raises this (HTTP 500) for reset_running_requests=true while a
# request waits for an asynchronous KV load: the loading blocks cannot be
# freed. The engine goes on; the caller may retry.
VLLM_PENDING_LOAD_REFUSAL = "waiting for remote KV transfer, which is not supported yet"


async def _reset(link: Link, url: str, query: str) -> str:
    resp = await link.http.post(f"{url}/reset_prefix_cache?{query}", timeout=60)
    if resp.status_code != 200:
        if VLLM_PENDING_LOAD_REFUSAL in resp.text:
            return "refused"  # vLLM's own limit; it preempted, then gave up
        return f"HTTP {resp.status_code}: {resp.text[:200]}"
    return "ok" if resp.json().get("success") else "refused"


# A refused reset is tried again this many times, RESET_RETRY_S apart, as a
# caller does: vLLM (and KVBM with it) refuses while blocks are in use (a
# request loading, a finished one whose stores are in flight), which under
# this traffic is most of the time.
RESET_TRIES = 5
RESET_RETRY_S = 0.2


async def _reset_loop(link: Link, url: str, cfg: SoakConfig, result: SoakResult) -> None:
    for n in itertools.count():  # until cancelled with the traffic
        await asyncio.sleep(cfg.reset_every)
        query = RESET_QUERIES[n % len(RESET_QUERIES)]
        for _ in range(RESET_TRIES):
            try:
                outcome = await _reset(link, url, query)
            except Exception as err:  # noqa: BLE001 - recorded, judged by check()
                outcome = f"{type(err).__name__}: {err}"
            if outcome != "refused":
                break
            await asyncio.sleep(RESET_RETRY_S)
        result.resets.append((query, outcome))


def _check_after_reset(server, model: str, req: SoakRequest, want: list[int]) -> str:
    """Resets every cache on the idle engine and repeats a prompt: it must be
    computed from scratch (nothing onboarded from before the reset) and
    correct. Returns what went wrong, or ""."""

    async def go():
        async with _link(server.url, 120) as link:
            outcome = await _reset(link, server.url, RESET_QUERIES[0])
            if outcome != "ok":
                return f"final reset on the idle engine: {outcome}"
            before = server.metric("kvbm_onboard_blocks_total")
            tokens, _ = await _one(link, model, req, 120)
            # The connector's counters reach /metrics at vLLM's logging interval.
            await asyncio.sleep(12)
            onboarded = server.metric("kvbm_onboard_blocks_total") - before
            if onboarded:
                return f"{onboarded:.0f} blocks onboarded after every cache was reset"
            if tokens != want:
                return f"wrong output after the reset: {tokens} != {want}"
            return ""

    return asyncio.run(go())


def run_soak(
    model: str, cfg: SoakConfig, want: dict | None = None, llm=None, log_path: str | None = None
) -> SoakResult:
    """Reference outputs first (one engine at a time: ``llm`` if given, else a
    fresh plain engine), then the soak against ``vllm serve``; returns the
    result with mismatches filled in."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from vllm_kvbm.tools.server import kvbm_transfer_config, vllm_server

    reqs = make_workload(cfg)
    if want is None:
        want = reference_outputs([r.prompt for r in reqs], cfg.max_tokens, llm=llm, model=model)
    kv = kvbm_transfer_config(host_cache_blocks=cfg.host_blocks) if cfg.kvbm else None
    # The reset endpoint exists in vLLM's development mode only.
    env = {"VLLM_SERVER_DEV_MODE": "1"} if cfg.reset_every > 0 else None
    with vllm_server(model, kv, serve_args(cfg), env=env, log_path=log_path) as server:
        result = asyncio.run(_run_requests(server.url, model, reqs, cfg))
        result.counters, result.not_idle = _settle(server, cfg.idle_timeout)
        if cfg.reset_every > 0 and cfg.kvbm and not result.not_idle:
            done = [i for i, out in enumerate(result.outputs) if out is not None]
            if done:
                req = reqs[max(done, key=lambda i: len(reqs[i].prompt))]
                result.after_reset = _check_after_reset(
                    server, model, req, want[tuple(req.prompt)][: req.max_tokens]
                )
        log = server.log_path
    result.mismatches = [
        i
        for i, out in enumerate(result.outputs)
        if out is not None and out != want[tuple(reqs[i].prompt)][: reqs[i].max_tokens]
    ]
    if result.errors or result.mismatches or result.not_idle:
        print(f"vllm serve log: {log}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = SoakConfig()
    parser.add_argument("--requests", type=int, default=d.requests)
    parser.add_argument("--concurrency", type=int, default=d.concurrency)
    parser.add_argument(
        "--duration-limit",
        type=float,
        default=d.duration_limit,
        help="deadline for all requests to finish, seconds",
    )
    parser.add_argument("--request-timeout", type=float, default=d.request_timeout)
    parser.add_argument("--model", default=None, help="model path (default: local model)")
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens)
    parser.add_argument("--engine-blocks", type=int, default=d.engine_blocks)
    parser.add_argument("--host-blocks", type=int, default=d.host_blocks)
    parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    parser.add_argument(
        "--doc-lengths",
        type=int,
        nargs="+",
        default=list(d.doc_lengths),
        help="token counts of the shared documents",
    )
    parser.add_argument("--cancel-fraction", type=float, default=d.cancel_fraction)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument(
        "--reset-every",
        type=float,
        default=d.reset_every,
        help="reset the prefix caches every this many seconds (0: never)",
    )
    parser.add_argument(
        "--no-overadmit",
        action="store_true",
        help="keep vLLM's admission check (fewer preemptions)",
    )
    parser.add_argument(
        "--no-kvbm", action="store_true", help="control run: the same workload on a plain server"
    )
    args = parser.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if args.model is None:
        from vllm_kvbm.tools.local_model import DEFAULT_DIR, build

        args.model = str(build(DEFAULT_DIR))
    cfg = SoakConfig(
        requests=args.requests,
        concurrency=args.concurrency,
        duration_limit=args.duration_limit,
        request_timeout=args.request_timeout,
        max_tokens=args.max_tokens,
        engine_blocks=args.engine_blocks,
        host_blocks=args.host_blocks,
        doc_lengths=tuple(args.doc_lengths),
        cancel_fraction=args.cancel_fraction,
        seed=args.seed,
        overadmit=not args.no_overadmit,
        max_num_batched_tokens=args.max_num_batched_tokens,
        reset_every=args.reset_every,
        kvbm=not args.no_kvbm,
    )
    print("Reference outputs on a plain engine, one prompt at a time ...", flush=True)
    t0 = time.perf_counter()
    want = reference_outputs(
        [r.prompt for r in make_workload(cfg)], cfg.max_tokens, model=args.model
    )
    print(f"  {len(want)} distinct prompts in {time.perf_counter() - t0:.0f} s", flush=True)
    print("Soak against vllm serve ...", flush=True)
    result = run_soak(args.model, cfg, want=want)
    print(summary(result, cfg))
    problems = check(result, cfg)
    for p in problems:
        print("FAIL:", p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
