"""A Gated DeltaNet hybrid's prefix read from a peer, as an operator runs it:
two `vllm serve` processes of a Qwen3-Next-shaped model (bf16, vLLM's hybrid
allocator on) on 127.0.0.1. Engine A serves its pool (pool_serve_port);
engine B, told by a router's hint that A holds the prefix, reads the
attention pages and each GDN group's state at the prefix's replay boundary
out of A's memory over UCX's TCP transport (as between machines) and
onboards them.

The reference is B itself serving the prefix from vLLM's own cache at the
same boundary (in bf16 a prompt computed whole rounds otherwise than its tail
over a cached prefix; test_hybrid_state_e2e explains): the KV and state B
reads from A must be exactly what B would have kept.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import pytest

from helpers import ROOT
from helpers.engines import RECOMPUTE, random_prompt
from helpers.system import shm_dir
from test_hybrid_state_e2e import GDN_ENGINE, assert_at_replay_boundaries
from test_peer_serve_e2e import SERVE_ENV as PEER_SERVE_ENV
from test_peer_serve_e2e import TCP, complete, counted, read_transports, wait_for
from test_request_params_e2e import Client
from vllm_kvbm.tools.local_model_archs import HYBRID_DIR, build_qwen3_next
from vllm_kvbm.tools.server import free_port, kvbm_transfer_config, vllm_server

pytestmark = pytest.mark.timeout(1800)

# vLLM keeps a prompt's state at its last full block before its last token
# (test_hybrid_state_e2e.gdn_hit): 700 -> 640, 2100 -> 2048 at 128-token blocks
LENGTHS = (700, 2100)
# The engine test_hybrid_state_e2e runs (one request a step, bf16, the block
# size vLLM picks), as `vllm serve` flags.
SERVE_ARGS = [f"--{k.replace('_', '-')}={v}" for k, v in GDN_ENGINE.items() if v is not None] + [
    "--enforce-eager",
    "--enable-prompt-tokens-details",
]
# Both servers on the same cores, so A computes the pages B would.
SERVE_ENV = {
    **PEER_SERVE_ENV,
    "VLLM_CPU_OMP_THREADS_BIND": f"0-{max(0, len(os.sched_getaffinity(0)) - 1)}",
}


@pytest.fixture(scope="module")
def qwen3_next():
    return str(build_qwen3_next(ROOT / HYBRID_DIR))


@pytest.fixture(scope="module")
def servers(qwen3_next, tmp_path_factory):
    port = free_port()
    logs = tmp_path_factory.mktemp("logs")
    with contextlib.ExitStack() as stack:
        a_kv = kvbm_transfer_config(
            host_cache_blocks=64,
            pool_cache_size="512MiB",
            # in memory (/dev/shm), as operators keep pool files
            pool_dir=stack.enter_context(shm_dir("kvbm-e2e-peer-hybrid-serve-")),
            pool_serve_port=port,
            pool_serve_host="127.0.0.1",
            load_split=False,
        )
        b_kv = kvbm_transfer_config(
            host_cache_blocks=64, peer_reads=True, peer_read_timeout_s=10, load_split=False
        )

        def serve(name: str, kv: dict, env: dict) -> Client:
            server = vllm_server(
                qwen3_next,
                kv,
                SERVE_ARGS,
                env={**SERVE_ENV, **env},
                startup_timeout=900,
                log_path=logs / f"{name}.log",
            )
            return Client(stack.enter_context(server))

        yield serve("a", a_kv, {}), serve("b", b_kv, TCP), port


def test_b_reads_a_gdn_hybrids_prefix_from_a_over_tcp_as_its_own_cache_would(servers):
    a, b, port = servers
    block = served_block_size(a)
    assert served_block_size(b) == block
    hint = {"router_hint": {"source_control_endpoint": f"tcp://127.0.0.1:{port}"}}
    prompts = [random_prompt(n, seed=9450 + n) for n in LENGTHS]
    for p in prompts:  # A computes them: its pool keeps the pages and states
        complete(a, p, None, reset=False)
    # A stores every full attention page (5 + 16 at 128-token blocks) and
    # each GDN group's state at each boundary where vLLM kept one (2 x 3)
    pages = sum(n // block for n in LENGTHS)
    assert wait_for(lambda: a.server.metric("kvbm_offload_blocks_total") >= pages, 30)
    assert wait_for(lambda: settled(a, "kvbm_offload_blocks_total"), 30)
    stored = a.server.metric("kvbm_offload_blocks_total")
    # every state at 128-token blocks (test_hybrid_state_e2e.assert_at_replay_boundaries)
    states = 3 * len(LENGTHS)
    assert stored == pages + states if block == 128 else stored <= pages + states
    want, hits = [], []
    for p in prompts:
        complete(b, p, RECOMPUTE)  # B computes it once, nothing stored...
        got, cached = complete(b, p, RECOMPUTE, reset=False)  # ...then from vLLM's own cache
        want.append(got)
        hits.append(cached)
    assert_at_replay_boundaries(hits, LENGTHS, block)
    for p, w, hit in zip(prompts, want, hits):
        got, cached = complete(b, p, hint)
        assert (got, cached) == (w, hit)
    assert counted(b, "peer", sum(hits))
    assert read_transports(Path(b.server.log_path)) == {"tcp"}


def settled(client, metric: str) -> bool:
    """The metric reads the same twice, a second apart."""
    first = client.server.metric(metric)
    time.sleep(1)
    return client.server.metric(metric) == first


def served_block_size(client) -> int:
    """The block size a `vllm serve` runs (vLLM's cache_config_info metric)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(client.server.metrics()):
        for sample in family.samples:
            if sample.name.startswith("vllm:cache_config_info"):
                return int(sample.labels["block_size"])
    raise AssertionError("no vllm:cache_config_info on /metrics")
