"""The workloads' client: drives one OpenAI-compatible server, writes CSV and summary.

    kvbm-bench multi-round --base-url http://127.0.0.1:8000 \
        --num-users 6 --num-rounds 4 --qps 0.5 --shared-system-prompt 1536 \
        --user-history-prompt 512 --answer-len 32 --output out.csv
    kvbm-bench doc-qa --base-url ... --num-documents 4 \
        --document-length 2000 --repeat-count 2 --hit-ratio 0.5 --output docs.csv

Every request is a greedy streaming completion with ``ignore_eos``, sent by the
openai client (``vllm_kvbm/tools/completions.py``); TTFT is the time to the
first streamed token. Every wait is bounded. Multi-round QA paces users as
LMBenchmark does (``arrival_gaps``), so requests of several users overlap; the
summary says how many were in flight at most, and splits TTFT by round and by
arrival (alone or queued behind another request in flight, ``arrivals.py``).
Percentiles are numpy's default (linear interpolation between the two nearest
ranks).
"""

from __future__ import annotations

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

import numpy as np

from vllm_kvbm.bench.arrivals import (
    ALONE,
    QUEUED,
    arrival_classes,
    others_in_flight,
    ttft_by_round_arrival,
)
from vllm_kvbm.bench.workloads import MultiRoundQA, TextSource, long_doc_qa
from vllm_kvbm.tools import completions

COLUMNS = [
    "prompt_tokens",
    "generation_tokens",
    "ttft",
    "generation_time",
    "user_id",
    "question_id",
    "launch_time",
    "finish_time",
]
# after LMBenchmark's columns, from the launch and finish times (arrivals.py)
ARRIVAL_COLUMNS = ["others_in_flight", "arrival"]


@dataclass
class Result:
    prompt_tokens: int
    generation_tokens: int
    ttft: float  # seconds from launch to the first token
    generation_time: float  # seconds from the first token to the last
    user_id: int
    question_id: int
    launch_time: float  # unix time
    finish_time: float  # unix time


@dataclass
class RunOutput:
    results: list[Result]
    errors: list[str]


async def _one(client, model: str, prompt, max_tokens: int, timeout: float):
    """One streamed completion: (launch unix time, ttft, total seconds, text,
    prompt tokens, generated tokens)."""
    out = await completions.stream(client, model, prompt, max_tokens, timeout)
    prompt_tokens = out.prompt_tokens if out.prompt_tokens is not None else -1
    gen_tokens = out.completion_tokens if out.completion_tokens is not None else sum(out.tokens)
    return out.launch, out.ttft, out.total, "".join(out.text), prompt_tokens, gen_tokens


async def _paced(
    items_ready: Callable, launch: Callable, qps: float, duration: float, done: Callable[[], bool]
) -> list[asyncio.Task]:
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


async def run_multi_round(
    base_url: str,
    model: str,
    workload: MultiRoundQA,
    qps: float,
    duration: float = 600,
    request_timeout: float = 300,
    on_result: Callable[[Result | None], None] = lambda r: None,
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

    async with completions.async_client(base_url, request_timeout) as client:
        start = time.monotonic()  # after the client is made (the first one imports openai)

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
                    launch_t, ttft, total, text, ptok, gtok = await _one(
                        client,
                        model,
                        workload.prompt(user),
                        workload.answer_tokens,
                        request_timeout,
                    )
                except Exception as err:  # noqa: BLE001 - recorded, the run goes on
                    errors.append(
                        f"user {user.user_id} round {user.rounds_done}: {type(err).__name__}: {err}"
                    )
                    on_result(None)
                    return  # this user's later rounds will not run
                r = Result(
                    ptok,
                    gtok,
                    ttft,
                    total - ttft,
                    user.user_id,
                    user.rounds_done,
                    launch_t,
                    launch_t + total,
                )
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


async def run_doc_qa(
    base_url: str,
    model: str,
    requests,
    answer_tokens: int,
    qps: float,
    duration: float = 600,
    request_timeout: float = 300,
    on_result: Callable[[Result | None], None] = lambda r: None,
) -> RunOutput:
    """Long document QA: the requests in order, one every 1/qps seconds."""
    results: list[Result] = []
    errors: list[str] = []
    queue = deque(requests)
    async with completions.async_client(base_url, request_timeout) as client:

        async def launch(req):
            try:
                launch_t, ttft, total, _, ptok, gtok = await _one(
                    client, model, req.prompt, answer_tokens, request_timeout
                )
                r = Result(
                    ptok,
                    gtok,
                    ttft,
                    total - ttft,
                    req.doc_id,
                    req.pass_index,
                    launch_t,
                    launch_t + total,
                )
                results.append(r)
                on_result(r)
            except Exception as err:  # noqa: BLE001
                errors.append(
                    f"document {req.doc_id} pass {req.pass_index}: {type(err).__name__}: {err}"
                )
                on_result(None)

        tasks = await _paced(
            lambda: queue.popleft() if queue else None, launch, qps, duration, lambda: not queue
        )
        if tasks:
            await asyncio.wait(tasks, timeout=request_timeout + 30)
    results.sort(key=lambda r: r.launch_time)
    return RunOutput(results, errors)


def concurrency(results: list[Result]) -> tuple[int, float]:
    """(most requests in flight at once, mean in flight over the run's span),
    from launch and finish times."""
    events = sorted(
        [(r.launch_time, 1) for r in results] + [(r.finish_time, -1) for r in results]
    )  # a finish before a launch
    now = peak = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    span = (
        max(r.finish_time for r in results) - min(r.launch_time for r in results)
        if results
        else 0.0
    )
    busy = sum(r.finish_time - r.launch_time for r in results)
    return peak, (busy / span if span > 0 else 0.0)


def summarize(results: list[Result], errors: list[str] | None = None) -> dict:
    ttfts = [r.ttft for r in results]
    span = (
        max(r.finish_time for r in results) - min(r.launch_time for r in results)
        if results
        else math.nan
    )
    peak, mean_in_flight = concurrency(results)
    per_round: dict[int, list[float]] = {}
    for r in results:
        per_round.setdefault(r.question_id, []).append(r.ttft)
    classes = arrival_classes(results)
    return {
        "requests": len(results),
        "errors": len(errors or []),
        "duration_s": span,
        "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else math.nan,
        **{
            f"ttft_p{q}_s": float(np.percentile(ttfts, q)) if ttfts else math.nan
            for q in (50, 90, 99)
        },
        "input_tokens_per_s": sum(r.prompt_tokens for r in results) / span if results else 0.0,
        "output_tokens_per_s": (
            sum(r.generation_tokens for r in results) / span if results else 0.0
        ),
        "max_in_flight": peak,
        "mean_in_flight": mean_in_flight,
        "ttft_mean_by_round_s": {str(k): sum(v) / len(v) for k, v in sorted(per_round.items())},
        "arrivals": {ALONE: classes.count(ALONE), QUEUED: classes.count(QUEUED)},
        "ttft_by_round_arrival": ttft_by_round_arrival(results),
    }


def write_csv(path: str | Path, results: list[Result]) -> None:
    """LMBenchmark's columns, then how many other requests were in flight when
    each was sent and its arrival class (alone or queued)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS + ARRIVAL_COLUMNS)
        writer.writeheader()
        for r, n in zip(results, others_in_flight(results)):
            writer.writerow({**asdict(r), "others_in_flight": n, "arrival": QUEUED if n else ALONE})


def read_csv(path: str | Path) -> list[Result]:
    types = {f.name: f.type for f in fields(Result)}
    with open(path, newline="") as f:
        # other columns (LMBenchmark's pandas index) are ignored
        return [
            Result(
                **{
                    k: (int(float(row[k])) if types[k] in ("int", int) else float(row[k]))
                    for k in COLUMNS
                }
            )
            for row in csv.DictReader(f)
        ]


def format_summary(s: dict) -> str:
    return (
        f"requests {s['requests']} (errors {s['errors']}), {s['duration_s']:.1f} s; "
        f"TTFT mean {s['ttft_mean_s']:.3f} s, p50 {s['ttft_p50_s']:.3f}, "
        f"p90 {s['ttft_p90_s']:.3f}, p99 {s['ttft_p99_s']:.3f}; "
        f"input {s['input_tokens_per_s']:.0f} tok/s, "
        f"output {s['output_tokens_per_s']:.1f} tok/s; "
        f"in flight: max {s.get('max_in_flight', 0)}, mean {s.get('mean_in_flight', 0):.2f}; "
        f"arrived alone {s.get('arrivals', {}).get(ALONE, 0)}, "
        f"queued {s.get('arrivals', {}).get(QUEUED, 0)}"
    )


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


class Unusable(Exception):
    """A server or model that cannot be used as given: the message names the
    flag and the fix; ``code`` is the exit code (1: not reached, 2: the
    arguments)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def served_models(base_url: str, flag: str, timeout: float = 30) -> list[tuple[str, str]]:
    """(name, root) of each model the server lists (vLLM's root: the path or
    repository it loaded); Unusable when it does not answer."""
    try:
        with completions.sync_client(base_url, timeout) as client:
            return [(m.id, getattr(m, "root", None) or m.id) for m in client.models.list()]
    except Exception as err:  # noqa: BLE001 - every way of not answering is one message
        raise Unusable(
            f"{flag}: cannot reach the server at {base_url} ({type(err).__name__}: "
            f"{err}); is it running, and is this its root URL (without /v1)?",
            1,
        ) from None


def pick_model(base_url: str, model: str | None, flag: str) -> tuple[str, str]:
    """(name to request, where its tokenizer is) for ``--model`` (or what the
    server lists when it is not given)."""
    listed = served_models(base_url, flag)
    names = [n for n, _ in listed]
    if model is None:
        if len(listed) != 1:
            raise Unusable(
                f"--model: the server at {base_url} ({flag}) serves "
                f"{', '.join(names) or 'no model'}: name one",
                2,
            )
        return listed[0]
    for name, root in listed:
        if model in (name, root):
            return name, root
    raise Unusable(
        f"--model {model}: the server at {base_url} ({flag}) serves "
        f"{', '.join(names) or 'no model'}; give one of those",
        2,
    )


def tokenizer_for(tokenizer: str | None, model: str, root: str):
    """The tokenizer that builds the prompts: ``--tokenizer``, else the
    model's name, else the path the server loaded it from."""
    tried = [tokenizer] if tokenizer else list(dict.fromkeys([model, root]))
    errors = []
    for name in tried:
        try:
            return load_tokenizer(name)
        except Exception as err:  # noqa: BLE001 - the next name may load
            errors.append(f"{name}: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
    raise Unusable(
        "--tokenizer: cannot load a tokenizer (" + "; ".join(errors) + "); give "
        "--tokenizer PATH_OR_HF_NAME of the model the server runs",
        2,
    )


def run_workload(args, base_url: str, model: str, tokenizer, on_result=lambda r: None) -> RunOutput:
    """Builds the workload named by ``args.workload`` and runs it (fresh text
    per call: the same seed gives the same prompts)."""
    source = TextSource(tokenizer, seed=args.seed)
    if args.workload == "multi-round":
        wl = MultiRoundQA(
            source,
            args.num_users,
            args.num_rounds,
            args.shared_system_prompt,
            args.user_history_prompt,
            args.answer_len,
        )
        return asyncio.run(
            run_multi_round(
                base_url, model, wl, args.qps, args.duration, args.request_timeout, on_result
            )
        )
    reqs = long_doc_qa(
        source,
        args.num_documents,
        args.document_length,
        args.repeat_count,
        args.hit_ratio,
        args.seed,
    )
    return asyncio.run(
        run_doc_qa(
            base_url,
            model,
            reqs,
            args.answer_len,
            args.qps,
            args.duration,
            args.request_timeout,
            on_result,
        )
    )


def workload_size(args) -> int:
    if args.workload == "multi-round":
        return args.num_users * args.num_rounds
    return args.num_documents * (args.repeat_count + 1)


def main(args) -> int:
    """multi-round or doc-qa, with the arguments cli.py parsed and checked."""
    from tqdm import tqdm

    args.workload = args.command
    try:
        model, root = pick_model(args.base_url, args.model, "--base-url")
        tokenizer = tokenizer_for(args.tokenizer, model, root)
    except Unusable as err:
        print(f"kvbm-bench {args.command}: {err}", file=sys.stderr)
        return err.code
    # not timed: the server's and the client's one-off costs (the client's
    # first request in a process takes tens of milliseconds more)
    completions.stream_sync(args.base_url, model, "warm up", max_tokens=2, timeout=120)
    with tqdm(total=workload_size(args), desc=args.workload, unit="req") as bar:
        out = run_workload(args, args.base_url, model, tokenizer, on_result=lambda r: bar.update(1))
    write_csv(args.output, out.results)
    summary = summarize(out.results, out.errors)
    summary["error_messages"] = out.errors[:20]
    Path(args.output).with_suffix(".summary.json").write_text(json.dumps(summary, indent=2))
    print(format_summary(summary))
    for e in out.errors[:5]:
        print("error:", e, file=sys.stderr)
    planned = workload_size(args)
    if len(out.results) < planned and not out.errors:
        print(
            f"error: {len(out.results)} of {planned} requests done within --time "
            f"{args.duration:g} s",
            file=sys.stderr,
        )
    return 0 if len(out.results) == planned and not out.errors else 1
