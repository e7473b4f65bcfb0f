"""A short soak: concurrent streaming requests with shared prefixes through
``vllm serve`` with KVBM, an engine KV cache and a host tier small enough to
preempt, evict and onboard constantly, some requests cancelled by the client;
every output is checked against a plain engine that recomputed the prompt
alone (benchmarks/soak.py is the long run).
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from conftest import MODEL_DIR, ROOT

pytestmark = pytest.mark.timeout(900)


def _soak_module():
    spec = importlib.util.spec_from_file_location("kvbm_soak", ROOT / "benchmarks" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_soak_outputs_match_and_nothing_hangs(model_dir, plain_llm):
    soak = _soak_module()
    cfg = soak.SoakConfig(
        requests=36, concurrency=12, max_tokens=12,
        doc_lengths=(1000, 1800, 2600), repeat_fraction=0.4,
        engine_blocks=28, host_blocks=40,
        # a few clients give up early: aborts while queued, loading or running
        cancel_fraction=0.15, cancel_within=6.0,
        # and some stop after one token, finishing while their stores are in flight
        one_token_fraction=0.15,
        # bounded everywhere: the machine may be shared with other engines
        request_timeout=240, duration_limit=360, idle_timeout=60, seed=2)
    # The reference runs first on the session's plain engine, one prompt at a
    # time; the soak server starts after it, so one engine computes at a time.
    result = soak.run_soak(str(MODEL_DIR), cfg, llm=plain_llm)
    print(soak.summary(result, cfg))
    problems = soak.check(result, cfg)
    assert not problems, "; ".join(problems) + "\n" + soak.summary(result, cfg)
    # the workload did what it is for
    assert len(result.outputs) - len(result.cancelled) >= 28
    assert result.counters["kvbm_offload_blocks_d2h_total"] > cfg.host_blocks
