"""Async OpenAI-compatible client: drives a workload, writes CSV and summary.

    kvbm-bench multi-round --base-url http://127.0.0.1:8000 --model M \
        --num-users 6 --num-rounds 4 --qps 0.5 --shared-system-prompt 1536 \
        --user-history-prompt 512 --answer-len 32 --output out.csv
    kvbm-bench doc-qa --base-url ... --model M --num-documents 4 \
        --document-length 2000 --repeat-count 2 --hit-ratio 0.5 --output docs.csv

Every request is a greedy streaming completion with ``ignore_eos``; TTFT is
the time to the first streamed token. Every wait is bounded. Multi-round QA
paces users as LMBenchmark does (``arrival_gaps``), so requests of several
users overlap; the summary says how many were in flight at most.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable

import aiohttp

from vllm_kvbm.bench.workloads import MultiRoundQA, TextSource, long_doc_qa

COLUMNS = ["prompt_tokens", "generation_tokens", "ttft", "generation_time",
           "user_id", "question_id", "launch_time", "finish_time"]


@dataclass
class Result:
    prompt_tokens: int
    generation_tokens: int
    ttft: float              # seconds from launch to the first token
    generation_time: float   # seconds from the first token to the last
    user_id: int
    question_id: int
    launch_time: float       # unix time
    finish_time: float       # unix time


@dataclass
class RunOutput:
    results: list[Result]
    errors: list[str]


async def stream_completion(session: aiohttp.ClientSession, base_url: str, model: str,
                            prompt, max_tokens: int, timeout: float):
    """One streamed completion: (launch unix time, ttft, total seconds, text,
    prompt tokens, generated tokens)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    launch = time.time()
    start = time.perf_counter()
    ttft = None
    pieces: list[str] = []
    usage = None
    async with session.post(f"{base_url.rstrip('/')}/v1/completions", json=body,
                            timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                if ttft is None:
                    ttft = time.perf_counter() - start
                pieces.append(choice.get("text") or "")
    total = time.perf_counter() - start
    if ttft is None:
        raise RuntimeError("the stream ended without a token")
    prompt_tokens = (usage or {}).get("prompt_tokens", -1)
    gen_tokens = (usage or {}).get("completion_tokens", len(pieces))
    return launch, ttft, total, "".join(pieces), prompt_tokens, gen_tokens


async def _paced(items_ready: Callable, launch: Callable, qps: float, duration: float,
                 done: Callable[[], bool]) -> list[asyncio.Task]:
    """Launches one request every 1/qps seconds while one is ready and the
    duration has not passed; returns the launched tasks."""
    interval = 1.0 / qps if qps > 0 else 0.0
    start = time.monotonic()
    next_at = start
    tasks: list[asyncio.Task] = []
    while not done() and time.monotonic() - start < duration:
        item = items_ready()
        if item is None:
            await asyncio.sleep(0.02)
            continue
        delay = next_at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(launch(item)))
        next_at = max(next_at, time.monotonic()) + interval
    return tasks


def arrival_gaps(num_users: int, num_rounds: int, qps: float) -> tuple[float, float]:
    """LMBenchmark's pacing (``UserSessionManager``): a user's rounds are
    ``num_users / qps`` seconds apart, and users join ``round gap x
    (num_rounds - 1) / num_users`` apart, so about ``num_users`` sessions are
    open at once and together they send ``qps`` requests per second."""
    if qps <= 0:
        return 0.0, 0.0
    round_gap = num_users / qps
    return round_gap, round_gap * (num_rounds - 1) / num_users


async def run_multi_round(base_url: str, model: str, workload: MultiRoundQA, qps: float,
                          duration: float = 600, request_timeout: float = 300,
                          on_result: Callable[[Result | None], None] = lambda r: None
                          ) -> RunOutput:
    """Synthetic multi-round QA with LMBenchmark's arrival pattern: users start
    staggered (``arrival_gaps``), each sends a round every round gap but never
    before its previous answer came back, so several users are in flight at
    once. Unlike LMBenchmark (whose first sessions start mid-conversation and
    which stops at a deadline), every user runs every round from round 0, so
    each configuration gets the same requests; no round starts after
    ``duration`` seconds."""
    results: list[Result] = []
    errors: list[str] = []
    round_gap, join_gap = arrival_gaps(workload.num_users, workload.num_rounds, qps)
    start = time.monotonic()

    async with aiohttp.ClientSession() as session:
        async def user_loop(user):
            next_at = start + user.user_id * join_gap
            while user.rounds_done < workload.num_rounds:
                delay = next_at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                if time.monotonic() - start >= duration:
                    return
                launched = time.monotonic()
                try:
                    launch_t, ttft, total, text, ptok, gtok = await stream_completion(
                        session, base_url, model, workload.prompt(user),
                        workload.answer_tokens, request_timeout)
                except Exception as err:  # noqa: BLE001 - recorded, the run goes on
                    errors.append(f"user {user.user_id} round {user.rounds_done}: "
                                  f"{type(err).__name__}: {err}")
                    on_result(None)
                    return  # this user's later rounds will not run
                r = Result(ptok, gtok, ttft, total - ttft, user.user_id, user.rounds_done,
                           launch_t, launch_t + total)
                results.append(r)
                workload.record_answer(user, text)
                on_result(r)
                next_at = launched + round_gap

        users = [asyncio.create_task(user_loop(u)) for u in workload.users]
        await asyncio.wait(users, timeout=duration + request_timeout + 30)
        for task in users:
            task.cancel()
    results.sort(key=lambda r: r.launch_time)
    return RunOutput(results, errors)


async def run_doc_qa(base_url: str, model: str, requests, answer_tokens: int, qps: float,
                     duration: float = 600, request_timeout: float = 300,
                     on_result: Callable[[Result | None], None] = lambda r: None) -> RunOutput:
    """Long document QA: the requests in order, one every 1/qps seconds."""
    results: list[Result] = []
    errors: list[str] = []
    queue = deque(requests)
    async with aiohttp.ClientSession() as session:
        async def launch(req):
            try:
                launch_t, ttft, total, _, ptok, gtok = await stream_completion(
                    session, base_url, model, req.prompt, answer_tokens, request_timeout)
                r = Result(ptok, gtok, ttft, total - ttft, req.doc_id, req.pass_index,
                           launch_t, launch_t + total)
                results.append(r)
                on_result(r)
            except Exception as err:  # noqa: BLE001
                errors.append(f"document {req.doc_id} pass {req.pass_index}: "
                              f"{type(err).__name__}: {err}")
                on_result(None)

        tasks = await _paced(lambda: queue.popleft() if queue else None, launch, qps,
                             duration, lambda: not queue)
        if tasks:
            await asyncio.wait(tasks, timeout=request_timeout + 30)
    results.sort(key=lambda r: r.launch_time)
    return RunOutput(results, errors)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def concurrency(results: list[Result]) -> tuple[int, float]:
    """(most requests in flight at once, mean in flight over the run's span),
    from launch and finish times."""
    events = sorted([(r.launch_time, 1) for r in results]
                    + [(r.finish_time, -1) for r in results])  # a finish before a launch
    now = peak = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    span = (max(r.finish_time for r in results) - min(r.launch_time for r in results)
            if results else 0.0)
    busy = sum(r.finish_time - r.launch_time for r in results)
    return peak, (busy / span if span > 0 else 0.0)


def summarize(results: list[Result], errors: list[str] | None = None) -> dict:
    ttfts = [r.ttft for r in results]
    span = (max(r.finish_time for r in results) - min(r.launch_time for r in results)
            if results else math.nan)
    peak, mean_in_flight = concurrency(results)
    per_round: dict[int, list[float]] = {}
    for r in results:
        per_round.setdefault(r.question_id, []).append(r.ttft)
    return {
        "requests": len(results),
        "errors": len(errors or []),
        "duration_s": span,
        "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else math.nan,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "ttft_p99_s": percentile(ttfts, 99),
        "input_tokens_per_s": sum(r.prompt_tokens for r in results) / span if results else 0.0,
        "output_tokens_per_s": (sum(r.generation_tokens for r in results) / span
                                if results else 0.0),
        "max_in_flight": peak,
        "mean_in_flight": mean_in_flight,
        "ttft_mean_by_round_s": {str(k): sum(v) / len(v) for k, v in sorted(per_round.items())},
    }


def write_csv(path: str | Path, results: list[Result]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for r in results:
            writer.writerow(asdict(r))


def read_csv(path: str | Path) -> list[Result]:
    types = {f.name: f.type for f in fields(Result)}
    with open(path, newline="") as f:
        # other columns (LMBenchmark's pandas index) are ignored
        return [Result(**{k: (int(float(row[k])) if types[k] in ("int", int) else float(row[k]))
                          for k in COLUMNS}) for row in csv.DictReader(f)]


def format_summary(s: dict) -> str:
    return (f"requests {s['requests']} (errors {s['errors']}), {s['duration_s']:.1f} s; "
            f"TTFT mean {s['ttft_mean_s']:.3f} s, p50 {s['ttft_p50_s']:.3f}, "
            f"p90 {s['ttft_p90_s']:.3f}, p99 {s['ttft_p99_s']:.3f}; "
            f"input {s['input_tokens_per_s']:.0f} tok/s, "
            f"output {s['output_tokens_per_s']:.1f} tok/s; "
            f"in flight: max {s.get('max_in_flight', 0)}, mean {s.get('mean_in_flight', 0):.2f}")


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def _no_default(action) -> bool:
    # `is`, not `in`: a default of 0 equals False
    return action.default is None or action.default is False or \
        action.default is argparse.SUPPRESS


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where its help already says it."""

    def _format_action(self, action):
        # argparse prints nothing after an option without help, not even its default
        if action.help is None and action.option_strings and not _no_default(action):
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action):
        text = action.help or ""
        if "default:" in text or _no_default(action):
            return text
        return super()._get_help_string(action)


def add_workload_args(p: argparse.ArgumentParser, workload: str) -> None:
    p.add_argument("--qps", type=float, default=0.5,
                   help="requests per second over all users (multi-round: LMBenchmark's "
                   "pacing, a user's rounds num_users/qps seconds apart)")
    p.add_argument("--time", "--duration", dest="duration", type=float, default=600,
                   help="stop launching new requests after this many seconds")
    p.add_argument("--request-timeout", type=float, default=300)
    p.add_argument("--seed", type=int, default=0)
    if workload == "multi-round":
        p.add_argument("--num-users", type=int, default=6)
        p.add_argument("--num-rounds", type=int, default=4)
        p.add_argument("--shared-system-prompt", type=int, default=1536,
                       help="tokens of the system prompt shared by all users")
        p.add_argument("--user-history-prompt", type=int, default=512,
                       help="tokens of each user's own history before round 0")
        p.add_argument("--answer-len", type=int, default=32)
    else:
        p.add_argument("--num-documents", type=int, default=4)
        p.add_argument("--document-length", type=int, default=2000)
        p.add_argument("--repeat-count", type=int, default=2)
        p.add_argument("--hit-ratio", type=float, default=0.5)
        p.add_argument("--answer-len", type=int, default=16)


def run_workload(args, base_url: str, model: str, tokenizer,
                 on_result=lambda r: None) -> RunOutput:
    """Builds the workload named by ``args.workload`` and runs it (fresh text
    per call: the same seed gives the same prompts)."""
    source = TextSource(tokenizer, seed=args.seed)
    if args.workload == "multi-round":
        wl = MultiRoundQA(source, args.num_users, args.num_rounds, args.shared_system_prompt,
                          args.user_history_prompt, args.answer_len)
        return asyncio.run(run_multi_round(base_url, model, wl, args.qps, args.duration,
                                           args.request_timeout, on_result))
    reqs = long_doc_qa(source, args.num_documents, args.document_length, args.repeat_count,
                       args.hit_ratio, args.seed)
    return asyncio.run(run_doc_qa(base_url, model, reqs, args.answer_len, args.qps,
                                  args.duration, args.request_timeout, on_result))


def workload_size(args) -> int:
    if args.workload == "multi-round":
        return args.num_users * args.num_rounds
    return args.num_documents * (args.repeat_count + 1)


def main(argv: list[str] | None = None, workload: str = "multi-round") -> int:
    p = argparse.ArgumentParser(prog=f"kvbm-bench {workload}",
                                description=f"{workload} workload against an "
                                "OpenAI-compatible endpoint", formatter_class=HelpFormatter)
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="model name the server serves")
    p.add_argument("--tokenizer", default=None, help="tokenizer to build prompts (default: model)")
    p.add_argument("--output", default=f"{workload}.csv", help="per-request CSV; the summary "
                   "goes next to it as .summary.json")
    add_workload_args(p, workload)
    args = p.parse_args(argv)
    args.workload = workload
    from tqdm import tqdm

    tokenizer = load_tokenizer(args.tokenizer or args.model)
    with tqdm(total=workload_size(args), desc=workload, unit="req") as bar:
        out = run_workload(args, args.base_url, args.model, tokenizer,
                           on_result=lambda r: bar.update(1))
    write_csv(args.output, out.results)
    summary = summarize(out.results, out.errors)
    summary["error_messages"] = out.errors[:20]
    Path(args.output).with_suffix(".summary.json").write_text(json.dumps(summary, indent=2))
    print(format_summary(summary))
    for e in out.errors[:5]:
        print("error:", e, file=sys.stderr)
    return 0 if out.results and not out.errors else 1
