"""Scheduler-side cost of the connector against vLLM's own scheduling, per step.

vLLM's real ``Scheduler`` with KVBMConnector and no model (the fake worker of
tests/helpers/scheduler_harness.py), in a GPU-like configuration: block size 16,
``--running`` running and ``--waiting`` waiting requests of ``--prompt-tokens``
tokens whose first ``--shared-tokens`` are one of ``--groups`` shared prefixes,
a host tier of ``--host-blocks`` slots and a disk tier (a real DiskView over a
temporary directory). The fake worker completes every store, load and spill in
the step that posts it, and creates the disk page file of every disk spill, so
lookups find pages on disk. Before the measured steps, ``--history`` prompts
are run and stored and vLLM's prefix cache is reset (they are long gone from
the engine, not from the tiers); ``--returning`` of all requests repeat one of
those or of the finished ones. Finished requests are replaced to keep the
waiting queue full.

Phases: filling the running set; draining, with the running set full, the
first queue (the first ``--running + --waiting`` requests, whose returning
ones repeat history prompts); then the measured steady state, whose
admissions are requests made during the run. Admissions are FCFS behind
``--waiting`` others (over a thousand steps at full size), so without the
drain the steady state would only admit the first queue's tail; and with the
lower tiers asked on the lookup thread, all of the first queue's returning
requests (whole prompt in the host tier then) are admitted in the first step,
ahead of fresh ones waiting a step for their lookups, so that tail held no
returning request and the steady state loaded nothing. After the drain a
returning request is admitted long after its prompt was stored (and written
through to disk): the host tier has turned over since, and it loads from disk.

Every scheduler-side method of the connector is wrapped with perf_counter
accounting. vLLM's time is ``schedule()`` plus ``update_from_output()`` minus
the connector's time inside them; the fake worker's time is in neither, and
garbage collection (which runs in whichever call allocates past a threshold)
is counted apart. The startup heap is frozen first, as vLLM's engine core does.
Printed: per phase (fill, drain, and the steady state split into decode-only
steps and steps with prefill or loads), ms per step of each and their ratio;
the bar is connector <= 10% of vLLM's step.

    .venv/bin/python benchmarks/bench_scheduler.py            # full size, a few minutes
    .venv/bin/python benchmarks/bench_scheduler.py --quick    # small, seconds
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import os
import random
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

# Methods of KVBMConnector that vLLM's scheduler calls (base-class ones too).
SCHEDULER_METHODS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "has_pending_push_work",
    "has_pending_block_frees",
    "get_kv_connector_stats",
    "take_events",
    "on_new_request",
    "get_loaded_kv_cache_group_ids",
    "get_external_cache_hit_sources",
    "register_finished_partial_tail",
    "get_finished_count",
)


class ConnectorClock:
    """perf_counter accounting of the connector's scheduler-side methods
    (less any garbage collection that ran inside them: see GCClock)."""

    def __init__(self, connector, gc_clock: "GCClock"):
        self.gc_clock = gc_clock
        self.total = 0.0
        self.by_method: dict[str, float] = defaultdict(float)
        self._depth = 0
        self.profiler = None  # a cProfile.Profile to run inside the methods
        for name in SCHEDULER_METHODS:
            method = getattr(connector, name, None)
            if callable(method):
                setattr(connector, name, self._wrap(name, method))

    def _wrap(self, name, method):
        @functools.wraps(method)
        def timed(*args, **kwargs):
            if self._depth:  # a wrapped method calling another: count once
                return method(*args, **kwargs)
            self._depth += 1
            gc_before = self.gc_clock.total
            if self.profiler is not None:
                self.profiler.enable()
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start - (self.gc_clock.total - gc_before)
                if self.profiler is not None:
                    self.profiler.disable()
                self._depth -= 1
                self.total += spent
                self.by_method[name] += spent

        return timed


class Workload:
    """Prompts of ``prompt_tokens``: a group's shared prefix, then unique tokens."""

    def __init__(self, args):
        import numpy as np

        self.rng = random.Random(args.seed)
        self.np_rng = np.random.default_rng(args.seed)
        self.args = args
        self.prefixes = [self._tokens(args.shared_tokens) for _ in range(args.groups)]
        self.finished: list[list[int]] = []
        self.made = self.returning = 0

    def _tokens(self, n: int) -> list[int]:
        return self.np_rng.integers(10, 99_000, size=n).tolist()

    def prompt(self) -> list[int]:
        self.made += 1
        if self.finished and self.rng.random() < self.args.returning:
            self.returning += 1
            return self.rng.choice(self.finished)
        prefix = self.rng.choice(self.prefixes)
        return prefix + self._tokens(self.args.prompt_tokens - len(prefix))

    def max_tokens(self) -> int:
        return self.rng.randint(self.args.min_decode, self.args.max_decode)


class GCClock:
    """Time in the garbage collector, which runs inside whichever call
    allocates when a threshold is crossed: counted apart from both."""

    def __init__(self):
        self.total = 0.0
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._start


class Phase:
    def __init__(self, name: str, part_of: "Phase | None" = None):
        self.name = name
        self.part_of = part_of  # a split of another phase's steps
        self.steps = 0
        self.vllm = self.connector = self.gc = 0.0
        self.by_method: dict[str, float] = defaultdict(float)
        self.running = self.waiting = 0
        self.stored = self.loaded = self.spilled = 0
        self.hits: dict[str, int] = defaultdict(int)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="small sizes for a test: seconds, not minutes"
    )
    p.add_argument("--running", type=int, default=256, help="max_num_seqs (running requests)")
    p.add_argument("--waiting", type=int, default=256, help="requests kept waiting")
    p.add_argument("--prompt-tokens", type=int, default=32768)
    p.add_argument(
        "--shared-tokens",
        type=int,
        default=16384,
        help="leading tokens of each prompt shared with its group",
    )
    p.add_argument("--groups", type=int, default=16, help="distinct shared prefixes")
    p.add_argument(
        "--returning",
        type=float,
        default=0.25,
        help="fraction of new requests that repeat an earlier prompt",
    )
    p.add_argument(
        "--history",
        type=int,
        default=64,
        help="prompts stored before the measured run (for returning requests)",
    )
    p.add_argument("--min-decode", type=int, default=512)
    p.add_argument("--max-decode", type=int, default=2048)
    p.add_argument("--host-blocks", type=int, default=100_000)
    p.add_argument(
        "--page-tokens",
        type=int,
        default=None,
        help="the connector's page_tokens (default: its own, 256 at block size "
        "16; 16: a page per block)",
    )
    p.add_argument("--max-batched", type=int, default=8192, help="max_num_batched_tokens")
    p.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="engine KV blocks (default: the running set's, unshared, +5%%)",
    )
    p.add_argument(
        "--fill-steps",
        type=int,
        default=1200,
        help="at most this many steps to fill the running set",
    )
    p.add_argument(
        "--drain-steps",
        type=int,
        default=4000,
        help="at most this many steps to admit the requests queued before "
        "the running set was full (timed, apart from the steady state)",
    )
    p.add_argument(
        "--steps", type=int, default=1000, help="steps measured in steady state (running set full)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--profile",
        metavar="FILE",
        help="cProfile the connector's methods (both phases) into FILE "
        "and print the top functions (times then include the profiler)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.running, args.waiting = 8, 8
        args.prompt_tokens, args.shared_tokens, args.groups = 2048, 1024, 2
        args.min_decode, args.max_decode = 4, 16
        args.host_blocks, args.max_batched = 600, 1024
        args.fill_steps, args.drain_steps, args.steps, args.history = 100, 400, 60, 4
    args.shared_tokens = min(args.shared_tokens, args.prompt_tokens)
    if args.num_blocks is None:
        bs = 16
        # every running request's own blocks (returning requests may load
        # their shared prefix into blocks of their own), +5%
        args.num_blocks = int(
            args.running * -(-(args.prompt_tokens + args.max_decode) // bs) * 1.05
        )
    return args


def run(args) -> list[Phase]:
    from helpers.scheduler_harness import BLOCK, kvbm, make_request, make_scheduler, worker_output
    from vllm.v1.request import RequestStatus

    from vllm_kvbm.tiers.page_names import disk_page_path

    assert BLOCK == 16
    disk_dir = tempfile.mkdtemp(prefix="kvbm-bench-sched-disk-")
    try:
        scheduler = make_scheduler(
            host_blocks=args.host_blocks,
            num_blocks=args.num_blocks,
            max_batched=args.max_batched,
            num_layers=2,
            max_model_len=args.prompt_tokens + args.max_decode + BLOCK,
            max_num_seqs=args.running,
            disk_cache_dir=disk_dir,
            disk_cache_size="64GiB",
            page_tokens=args.page_tokens,
        )  # None: the connector's default
        args.page_tokens = kvbm(scheduler).info.page_tokens
        sched = kvbm(scheduler)
        assert sched.lower, "no disk tier"
        info = sched.info
        g = info.page_blocks
        namespace = info.tier_namespace
        gc_clock = GCClock()
        clock = ConnectorClock(scheduler.connector, gc_clock)
        work = Workload(args)
        prompts: dict[str, list[int]] = {}

        def add_request():
            prompt = work.prompt()
            req = make_request(prompt, max_tokens=work.max_tokens())
            prompts[req.request_id] = prompt
            scheduler.add_request(req)
            return req

        def fake_worker(out):
            meta = out.kv_connector_metadata
            for spill in meta.spills:  # the fake worker writes the disk pages
                if "disk" in spill.tiers:
                    for key in spill.keys:
                        open(
                            disk_page_path(disk_dir, namespace, info.page_bytes, 0, 1, key), "wb"
                        ).close()
            return worker_output(
                scheduler, out, complete=True, spills_done=[s.job_id for s in meta.spills]
            )

        # History, not measured: earlier prompts the tiers hold, which
        # returning requests ask for again.
        for _ in range(args.history):
            req = make_request(work.prompt(), max_tokens=1)
            prompts[req.request_id] = req.prompt_token_ids
            scheduler.add_request(req)
        history_steps = 0
        while scheduler.requests:
            out = scheduler.schedule()
            for eco in scheduler.update_from_output(out, fake_worker(out)).values():
                for o in eco.outputs:
                    if o.finish_reason is not None:
                        work.finished.append(prompts.pop(o.request_id))
            history_steps += 1
        args.history_steps = history_steps
        # Long ago for the engine: its own prefix cache has moved on (the
        # connector's tiers are kept).
        assert scheduler.reset_prefix_cache()

        # The first queue: drained before the steady state is measured.
        first_queue = [add_request() for _ in range(args.running + args.waiting)]

        # As vLLM's engine core does once it is up: the block pool and the
        # rest of the startup heap are never scanned by the collector again.
        from vllm.utils.gc_utils import freeze_gc_heap

        freeze_gc_heap()
        fill, drain, steady = Phase("fill"), Phase("drain (first queue)"), Phase("steady")
        decode_only = Phase("steady, decode-only steps", part_of=steady)
        with_prefill = Phase("steady, steps with prefill or loads", part_of=steady)
        phases = [fill, drain, steady, decode_only, with_prefill]
        phase = fill
        steps_left = args.fill_steps
        if args.profile:
            import cProfile

            clock.profiler = cProfile.Profile()
        while True:
            if phase is fill and (len(scheduler.running) >= args.running or steps_left == 0):
                phase, steps_left = drain, args.drain_steps
            if phase is drain:
                # Left the waiting queue once (running, loading, finished).
                first_queue = [
                    r
                    for r in first_queue
                    if r.status == RequestStatus.WAITING and r.num_computed_tokens == 0
                ]
                if not first_queue or steps_left == 0:
                    args.drain_left = len(first_queue)
                    phase, steps_left = steady, args.steps
            if steps_left == 0:
                break
            steps_left -= 1
            before = clock.total, dict(clock.by_method)
            gc0 = gc_clock.total
            t0 = time.perf_counter()
            out = scheduler.schedule()
            t1 = time.perf_counter()
            gc1 = gc_clock.total
            meta = out.kv_connector_metadata
            mro = fake_worker(out)
            gc2 = gc_clock.total
            t2 = time.perf_counter()
            engine_outputs = scheduler.update_from_output(out, mro)
            t3 = time.perf_counter()
            spent = clock.total - before[0]
            collected = (gc1 - gc0) + (gc_clock.total - gc2)
            targets = [phase]
            if phase is steady:
                decoding = (
                    not out.scheduled_new_reqs
                    and not meta.loads
                    and sum(out.num_scheduled_tokens.values()) == len(out.num_scheduled_tokens)
                )
                targets.append(decode_only if decoding else with_prefill)
            for ph in targets:
                ph.steps += 1
                ph.connector += spent
                ph.gc += collected
                ph.vllm += (t1 - t0) + (t3 - t2) - spent - collected
                for name, total in clock.by_method.items():
                    ph.by_method[name] += total - before[1].get(name, 0.0)
                ph.running += len(scheduler.running)
                ph.waiting += scheduler.get_num_unfinished_requests() - len(scheduler.running)
                ph.stored += sum(len(job.block_ids) for job in meta.stores)
                ph.spilled += g * sum(len(s.keys) for s in meta.spills)
                for job in meta.loads:
                    ph.loaded += job.num_blocks
                    fetched = {i: src for i, src, _ in job.fetch}
                    for i in range(len(job.slots)):
                        ph.hits[fetched.get(i, "host")] += g
            finished = 0
            for eco in engine_outputs.values():
                for o in eco.outputs:
                    if o.finish_reason is not None:
                        finished += 1
                        work.finished.append(prompts.pop(o.request_id))
            del work.finished[: -4 * args.running]  # returning prompts: recent ones
            for _ in range(finished):
                add_request()
        assert not any(
            r.status == RequestStatus.FINISHED_ERROR for r in scheduler.requests.values()
        )
        if clock.profiler is not None:
            import pstats

            clock.profiler.dump_stats(args.profile)
            pstats.Stats(args.profile).sort_stats("tottime").print_stats(20)
        return phases
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)


def report(args, phases: list[Phase]) -> None:
    print(
        f"vLLM Scheduler + KVBMConnector, no model: block size 16, max_num_seqs "
        f"{args.running}, {args.waiting} waiting, prompts of {args.prompt_tokens} tokens "
        f"({args.shared_tokens} shared in {args.groups} groups), max_num_batched_tokens "
        f"{args.max_batched}, engine {args.num_blocks} blocks, host tier "
        f"{args.host_blocks} blocks in pages of {args.page_tokens} tokens (page_tokens), "
        f"disk tier (DiskView over a tmp dir); "
        f"{args.history} prompts stored first ({args.history_steps} steps, not "
        f"measured), {100 * args.returning:.0f}% of requests return to one"
    )
    print()
    print(
        "| phase | steps | running | waiting | vLLM ms/step | connector ms/step "
        "| connector / vLLM | GC ms/step |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for ph in phases:
        if not ph.steps:
            continue
        n = ph.steps
        print(
            f"| {ph.name} | {n} | {ph.running / n:.0f} | {ph.waiting / n:.0f} "
            f"| {1e3 * ph.vllm / n:.2f} | {1e3 * ph.connector / n:.3f} "
            f"| {100 * ph.connector / ph.vllm:.1f}% | {1e3 * ph.gc / n:.2f} |"
        )
    print()
    for ph in phases:
        if not ph.steps:
            continue
        n = ph.steps
        methods = ", ".join(
            f"{name} {1e3 * t / n:.3f}"
            for name, t in sorted(ph.by_method.items(), key=lambda x: -x[1])
            if t > 0
        )
        hits = ", ".join(f"{k} {v}" for k, v in sorted(ph.hits.items())) or "none"
        print(
            f"{ph.name}: blocks stored {ph.stored}, spilled {ph.spilled}, loaded "
            f"{ph.loaded} ({hits}); connector ms/step by method: {methods}"
        )
    total_v = sum(ph.vllm for ph in phases if ph.part_of is None)
    total_c = sum(ph.connector for ph in phases if ph.part_of is None)
    verdict = "meets" if total_c <= 0.10 * total_v else "misses"
    if args.drain_left:
        print(
            f"({args.drain_left} requests of the first queue were still waiting after "
            f"{args.drain_steps} drain steps)"
        )
    print(
        f"overall: connector adds {100 * total_c / total_v:.1f}% to vLLM's scheduling "
        f"time per step ({verdict} the 10% bar)"
    )


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    logging.getLogger("vllm_kvbm").setLevel(logging.WARNING)
    start = time.perf_counter()
    phases = run(args)
    report(args, phases)
    print(f"(run took {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
