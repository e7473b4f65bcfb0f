"""`vllm serve` with the connector named by the plugin alone: no
kv_connector_module_path, as vLLM's own connectors are named."""

from __future__ import annotations

import pytest

from vllm_kvbm.tools.server import vllm_server

pytestmark = pytest.mark.timeout(900)

SERVE_ARGS = [
    "--enforce-eager",
    "--max-model-len",
    "2048",
    "--gpu-memory-utilization",
    "0.25",
    "--num-gpu-blocks-override",
    "32",
]


def test_serve_with_only_the_connector_name(model_dir):
    config = {"kv_connector": "KVBMConnector", "kv_role": "kv_both"}
    # The host tier's size from the environment keeps the config to the two keys
    # and the pinned memory small.
    with vllm_server(
        str(model_dir),
        config,
        SERVE_ARGS,
        startup_timeout=600,
        env={"KVBM_HOST_CACHE_SIZE": "64MiB", "VLLM_LOGGING_LEVEL": "INFO"},
    ) as server:
        prompt = " ".join(f"word{i % 97}" for i in range(700))  # several 128-token blocks
        _, _, text = server.stream_completion(prompt, max_tokens=4)
        assert text
        metrics = server.metrics()
        offloaded = server.metric("kvbm_offload_blocks_total")
    assert "kvbm_offload_blocks_total" in metrics
    assert offloaded >= 1, metrics[:2000]
    # the engine's totals, logged once (by the scheduler, not by each worker)
    totals = [
        line
        for line in server.log_path.read_text().splitlines()
        if "KVBM: this engine takes host tier" in line
    ]
    assert len(totals) == 1, totals
    assert "per worker x 1 worker(s)" in totals[0] and "are per worker" in totals[0]
    # what was configured and from where, once per engine too
    listing = [
        line
        for line in server.log_path.read_text().splitlines()
        if "KVBM: configuration (values set, with their source): " in line
    ]
    assert len(listing) == 1, listing
    assert listing[0].endswith(
        f"host_cache_size={64 * 1024**2} bytes (0.06 GiB) from KVBM_HOST_CACHE_SIZE"
    ), listing
