"""Where a host-tier hit's time goes, next to vLLM's own prefix hit.

One engine, run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so
the scheduler, the worker and the connector can be timed together: per
engine step, its start, the tokens scheduled, the forward pass
(``execute_model``), and the connector's lookup, load post, copy and
completion report. Per prompt length: a miss (stored to the host tier),
vLLM's own hit, then ``reset_prefix_cache()`` and a host-tier hit; each
best of ``--repeats`` fresh prompts (another machine load hits all alike).

``--sync-loads`` is an experiment, not a mode of the connector: host-only
hits are returned to vLLM as synchronous loads (``load_kv_async=False``: the
request is scheduled in the same step, and the worker waits for the copy in
``start_load_kv`` before the forward pass) instead of waiting a step in
WAITING_FOR_REMOTE_KVS. It measures what the asynchronous protocol's extra
scheduler step costs. The experiment never unpins the loaded host slots.

    .venv/bin/python benchmarks/profile_host_hit.py [--lengths 8192 16384] [--repeats 3] [--sync-loads]
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import time
from collections import defaultdict

BLOCK_SIZE = 128
EVENTS: list[tuple[float, str, float, object]] = []  # (start, what, seconds, detail)


def timed(cls, name: str, detail=None):
    """Records every call of ``cls.name``: start, duration, detail(result)."""
    fn = getattr(cls, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        EVENTS.append(
            (
                start,
                f"{cls.__name__}.{name}",
                time.perf_counter() - start,
                detail(args, result) if detail else None,
            )
        )
        return result

    setattr(cls, name, wrapper)


def instrument() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_kvbm.connector import KVBMConnector
    from vllm_kvbm.worker import page_mover

    timed(EngineCore, "step")
    timed(Scheduler, "schedule", lambda a, out: out.total_num_scheduled_tokens)
    timed(Scheduler, "update_from_output")
    timed(GPUModelRunner, "execute_model")
    timed(KVBMConnector, "get_num_new_matched_tokens", lambda a, r: r)
    timed(KVBMConnector, "update_state_after_alloc")
    timed(
        KVBMConnector, "build_connector_meta", lambda a, m: sum(len(j.block_ids) for j in m.loads)
    )
    timed(KVBMConnector, "start_load_kv")
    timed(KVBMConnector, "get_finished", lambda a, r: len(r[1]))
    timed(page_mover.PageMover, "post", lambda a, h: len(a[2]))
    # the copy itself (on the mover's copy thread: one NIXL post per transfer)
    timed(page_mover._nixl_api()[0], "transfer", lambda a, s: s)


def make_loads_synchronous() -> None:
    """The ``--sync-loads`` experiment (see the module docstring)."""
    from vllm_kvbm.scheduler.planner import KVBMScheduler
    from vllm_kvbm.worker.worker import KVBMWorker

    lookup = KVBMScheduler.get_num_new_matched_tokens

    def sync_lookup(self, request, num_computed_tokens):
        n, load_async = lookup(self, request, num_computed_tokens)
        state = self._reqs.get(request.request_id)
        if (
            n
            and state is not None
            and set(state.lookup.hit_sources[: n // self.block_size]) == {"host"}
        ):
            return n, False
        return n, load_async

    start = KVBMWorker.start_loads

    def start_and_wait(self, meta):
        start(self, meta)
        sync = {job.req_id for job in meta.loads if not job.fetch}
        if sync:
            self._wait(lambda job, is_store: not is_store and job.req_id in sync)
            # vLLM expects no finished_recving for a synchronous load.
            self._finished_recving -= sync

    KVBMScheduler.get_num_new_matched_tokens = sync_lookup
    KVBMWorker.start_loads = start_and_wait


def ttft(llm, prompt: list[int]) -> tuple[float, list]:
    from vllm import SamplingParams

    EVENTS.clear()
    params = SamplingParams(temperature=0.0, max_tokens=1)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    end = time.perf_counter()
    return end - start, [(t - start, what, dur, d) for t, what, dur, d in EVENTS]


def breakdown(total: float, events: list) -> dict[str, float]:
    """ms per part: steps that ran the model vs steps that did not, the
    connector's parts, and the time outside engine steps."""
    parts: dict[str, float] = defaultdict(float)
    steps = [e for e in events if e[1] == "EngineCore.step"]
    forwards = [e for e in events if e[1] == "GPUModelRunner.execute_model"]
    scheduled = [e for e in events if e[1] == "Scheduler.schedule"]
    for (t, _, dur, _), (_, _, _, tokens) in zip(steps, scheduled):
        parts["steps with a forward pass" if tokens else "steps without one (waiting)"] += dur
        parts["engine steps"] += dur
    parts["forward passes (execute_model)"] = sum(e[2] for e in forwards if e[2] > 0.002)
    for what in (
        "KVBMConnector.get_num_new_matched_tokens",
        "KVBMConnector.start_load_kv",
        "KVBMConnector.get_finished",
        "KVBMConnector.build_connector_meta",
        "PageMover.post",
        "nixl_agent.transfer",
    ):
        parts[what] = sum(e[2] for e in events if e[1] == what)
    parts["outside engine steps (generate, detokenize)"] = total - parts["engine steps"]
    copies = [e for e in events if e[1] == "nixl_agent.transfer"]
    computing = [st for st, sc in zip(steps, scheduled) if sc[3]]
    if copies and computing:
        parts["generate() to copy start"] = copies[0][0]
        parts["copy end to the step that computes the rest"] = computing[0][0] - (
            copies[-1][0] + copies[-1][2]
        )
    parts["engine steps (count)"] = len(steps)
    parts["steps scheduling tokens (count)"] = sum(1 for s in scheduled if s[3])
    return {k: v * (1 if "count" in k else 1000) for k, v in parts.items()}


def run(model: str, lengths: list[int], repeats: int) -> None:
    from vllm import LLM

    from vllm_kvbm.tools.server import kvbm_transfer_config

    instrument()
    longest = max(lengths)
    from vllm_kvbm.tools.compute_dtype import compute_dtype, describe

    print(f"dtype: {describe()}", flush=True)
    llm = LLM(
        model=model,
        dtype=compute_dtype(),
        block_size=BLOCK_SIZE,
        enforce_eager=True,
        max_model_len=longest + BLOCK_SIZE,
        max_num_batched_tokens=8192,
        kv_cache_memory_bytes=2 << 30,
        gpu_memory_utilization=0.3,
        kv_transfer_config=kvbm_transfer_config(host_cache_size="4GiB"),
    )
    ttft(llm, [11] * 64)
    for n in lengths:
        best: dict[str, tuple[float, list]] = {}
        for r in range(repeats):
            rng = random.Random(n * 100 + r)
            prompt = [rng.randrange(10, 7000) for _ in range(n)]
            ttft(llm, prompt)  # miss: computes, stores to the host tier
            time.sleep(0.5)
            for kind in ("vLLM hit", "host hit"):
                if kind == "host hit":
                    llm.reset_prefix_cache()
                t, ev = ttft(llm, prompt)
                if kind not in best or t < best[kind][0]:
                    best[kind] = (t, ev)
        print(
            f"\n## {n} tokens: best of {repeats}: vLLM hit {best['vLLM hit'][0] * 1000:.1f} ms, "
            f"host hit {best['host hit'][0] * 1000:.1f} ms, ratio "
            f"{best['host hit'][0] / best['vLLM hit'][0]:.2f}"
        )
        rows = {k: breakdown(*v) for k, v in best.items()}
        print("| part | vLLM hit | host hit |\n|---|---:|---:|")
        for part in rows["host hit"]:
            unit = "" if "count" in part else " ms"
            print(
                f"| {part} | {rows['vLLM hit'].get(part, 0):.1f}{unit} "
                f"| {rows['host hit'][part]:.1f}{unit} |"
            )
        print(
            "\nhost hit timeline (ms from generate(); duration; detail), without the "
            "steps that only wait for the copy:"
        )
        for t, what, dur, d in sorted(best["host hit"][1]):
            if (
                dur < 0.001
                and what
                not in (
                    "KVBMConnector.get_num_new_matched_tokens",
                    "PageMover.post",
                    "nixl_agent.transfer",
                )
                and not (what == "KVBMConnector.get_finished" and d)
            ):
                continue
            print(f"  {t * 1000:8.2f}  {what:45s} {dur * 1000:7.2f}  {'' if d is None else d}")
    import threading

    print(
        "\ncores: engine thread",
        sorted(os.sched_getaffinity(0)),
        "".join(
            f", {t.name} {sorted(os.sched_getaffinity(t.native_id))}"
            for t in threading.enumerate()
            if t.name.endswith("-copy")
        ),
    )
    llm.llm_engine.engine_core.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--sync-loads", action="store_true", help="experiment: host-only hits as synchronous loads"
    )
    args = parser.parse_args()
    if args.sync_loads:
        make_loads_synchronous()
    if args.model is None:
        from vllm_kvbm.tools.local_model import DEFAULT_DIR, build

        args.model = str(build(DEFAULT_DIR))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # The cores benchmarks/bench_host_tier.py gives its engine (vLLM would
    # reserve one more core for an engine with a KV connector).
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    run(args.model, args.lengths, args.repeats)


if __name__ == "__main__":
    main()
