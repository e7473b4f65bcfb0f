"""config_identity (vllm_kvbm/identity_fields.py) on real engines.

The scheduler process and every worker process compute the same identity,
after the workers loaded the model (TP=2, eager) or compiled it (TP=1):
values vLLM resolves in one process only are harmless, or the two sides
would name every page differently. (An engine with --hf-overrides on another
engine's disk directory loads none of its pages: test_identity_e2e.)"""

from __future__ import annotations

import json

import pytest

from helpers.engines import make_llm, random_prompt, shutdown
from test_engine_e2e import generate
from vllm_kvbm.tools.server import kvbm_transfer_config

pytestmark = pytest.mark.timeout(900)


@pytest.mark.parametrize("eager,tp", [(True, 2), (False, 1)], ids=["eager-tp2", "compiled"])
def test_scheduler_and_workers_agree(model_dir, tmp_path, monkeypatch, eager, tp):
    """Compiled, the workers fill compilation_config's runtime fields (custom
    ops seen, traced files, forward context) that the scheduler's copy lacks:
    one worker shows it. Both ranks of a TP=2 engine agree too (eager)."""
    if tp == 2:
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    monkeypatch.setenv("KVBM_IDENTITY_PROBE_DIR", str(tmp_path))
    kv = kvbm_transfer_config(host_cache_size="64MiB")
    kv.update(kv_connector="IdentityProbeConnector", kv_connector_module_path="identity_probe")
    llm = make_llm(
        kv,
        tensor_parallel_size=tp,
        kv_cache_memory_bytes=256 << 20,
        max_model_len=4096,
        max_num_batched_tokens=4096,
        enforce_eager=eager,
    )
    try:
        generate(llm, [random_prompt(300, seed=11)])
    finally:
        shutdown(llm)
    seen = {p.name: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert sorted(name.split("-")[0] for name in seen) == ["scheduler"] + ["worker"] * tp
    scheduler = next(v for k, v in seen.items() if k.startswith("scheduler"))
    for name, identity in seen.items():
        differs = {
            k for k in scheduler["config"] if scheduler["config"][k] != identity["config"].get(k)
        }
        assert identity == scheduler, (name, differs)
    assert scheduler["config"]["parallel_config"]["tensor_parallel_size"] == tp
