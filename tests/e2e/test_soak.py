"""A short soak: concurrent streaming requests with shared prefixes through
``vllm serve`` with KVBM, an engine KV cache and a host tier small enough to
preempt, evict and onboard constantly, some requests cancelled by the client;
every output is checked against a plain engine that recomputed the prompt
alone (benchmarks/soak.py is the long run), with cache resets in the middle
of the traffic.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys

import pytest

from helpers import ROOT
from helpers.engines import MODEL_DIR

pytestmark = pytest.mark.timeout(900)


def _soak_module():
    sys.path.append(str(ROOT / "benchmarks"))  # soak.py imports its sibling soak_report
    spec = importlib.util.spec_from_file_location("kvbm_soak", ROOT / "benchmarks" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


soak = _soak_module()
CFG = soak.SoakConfig(
    requests=24,
    concurrency=8,
    max_tokens=12,
    # The engine holds one long prompt and a bit: concurrent ones preempt.
    doc_lengths=(600, 1000, 1400),
    repeat_fraction=0.4,
    engine_blocks=16,
    host_blocks=24,
    # a few clients give up early: aborts while queued, loading or running
    cancel_fraction=0.15,
    cancel_within=6.0,
    # and some stop after one token, finishing while their stores are in flight
    one_token_fraction=0.15,
    # bounded everywhere: the machine may be shared with other engines
    request_timeout=240,
    duration_limit=360,
    idle_timeout=60,
    seed=2,
)


@pytest.fixture(scope="module")
def reference(model_dir, plain_llm):
    # On the session's plain engine, one prompt at a time, before any soak
    # server starts, so one engine computes at a time.
    prompts = [r.prompt for r in soak.make_workload(CFG)]
    return soak.reference_outputs(prompts, CFG.max_tokens, llm=plain_llm)


def _run(cfg, reference):
    result = soak.run_soak(str(MODEL_DIR), cfg, want=reference)
    print(soak.summary(result, cfg))
    problems = soak.check(result, cfg)
    assert not problems, "; ".join(problems) + "\n" + soak.summary(result, cfg)
    # the workload did what it is for
    assert len(result.outputs) - len(result.cancelled) >= 16
    assert result.counters["kvbm_offload_blocks_total"] > cfg.host_blocks
    # KVBM's hit counter and vLLM's agree even under preemption and retries
    assert (
        result.counters["kvbm_matched_tokens_total"]
        == result.counters["vllm:external_prefix_cache_hits_total"]
        > 0
    )
    return result


def test_soak_with_cache_resets_under_traffic(reference):
    # The soak's traffic (preemption, eviction, onboarding, aborts) and, on
    # top, POST /reset_prefix_cache every 2 s, cycling through keeping or
    # preempting running requests and keeping or clearing KVBM's tiers; then a
    # full reset of the idle engine must leave nothing to onboard.
    cfg = dataclasses.replace(CFG, reset_every=2.0)
    result = _run(cfg, reference)
    assert sum(outcome == "ok" for _, outcome in result.resets) >= 2, result.resets
    assert {q for q, o in result.resets if o == "ok"} & {
        q for q in soak.RESET_QUERIES if "reset_external=true" in q
    }, result.resets
