"""`vllm serve` with the plugin, as users start it: startup errors, a remote
tier that does not answer, and the demo."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from helpers.engines import MODEL_DIR, random_prompt
from vllm_kvbm.tools.server import (
    free_port,
    kvbm_transfer_config,
    start_lmcache_server,
    stop_process,
    vllm_server,
)

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


def startup_error(extra: dict) -> str:
    """Starts `vllm serve` with this extra config; returns the log of its failed startup."""
    with pytest.raises(RuntimeError) as err:
        with vllm_server(
            str(MODEL_DIR), kvbm_transfer_config(**extra), SERVE_ARGS, startup_timeout=300
        ):
            pass
    return err.value.args[0]


def assert_names(log: str, expected: list[str]) -> None:
    for text in expected:
        assert text in log, log[-2000:]


def test_bad_config_stops_startup_with_a_clear_message(model_dir):
    """One bad key through a real `vllm serve`: the message reaches its log,
    from the API server, before an engine core starts (startup_check.py).
    Every other startup error, on the connector's start path without a
    server: tests/unit/test_startup_errors.py."""
    log = startup_error({"host_cache_sise": "1GiB"})
    assert_names(log, ["unknown key 'host_cache_sise'", "did you mean 'host_cache_size'"])
    assert "Engine core initialization failed" not in log and "EngineCore" not in log, log[-2000:]


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(1)


def test_remote_url_that_does_not_answer_costs_only_its_hits(model_dir):
    # Nothing listens on the port: the engine starts and serves, the remote
    # tier's writes fail fast (logged, counted), the host tier still hits; once
    # an LMCache server appears there, the remote tier is used. The host copies
    # by the threaded path, fixed from the operator's environment.
    port = free_port()
    url = f"lm://127.0.0.1:{port}"
    kv = kvbm_transfer_config(host_cache_blocks=64, remote_url=url, remote_timeout_s=1)
    env = {
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_LOGGING_LEVEL": "INFO",
        "KVBM_HOST_COPY_PATH": "threads",
    }
    with vllm_server(str(MODEL_DIR), kv, SERVE_ARGS, startup_timeout=300, env=env) as server:
        [copies] = [
            line for line in server.log_path.read_text().splitlines() if "copies by" in line
        ]
        assert "copies by memory copies in" in copies and copies.endswith("(host_copy_path)")
        prompt = random_prompt(3 * 128 + 10, seed=4242)
        _, _, first = server.stream_completion(prompt, max_tokens=8, timeout=120)
        # vLLM's own prefix cache forgets the prompt; KVBM's host tier keeps it.
        reset = urllib.request.Request(f"{server.url}/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(reset, timeout=60) as resp:
            assert json.load(resp)["success"]
        _, _, again = server.stream_completion(prompt, max_tokens=8, timeout=120)
        assert again == first
        wait_for(
            lambda: server.metric("kvbm_tier_write_failed_pages_total") >= 3,
            60,
            "failed remote writes counted",
        )
        assert server.metric("kvbm_onboard_blocks_total") == 3  # the host tier hit
        assert server.metric("kvbm_tier_write_pages_total", tier="remote") == 0
        assert server.metric("kvbm_tier_up", tier="remote") == 0
        assert server.metric("kvbm_tier_reconnects_total", tier="remote") == 0
        assert f"remote tier {url} unavailable" in server.log_path.read_text()
        lmcache = start_lmcache_server(port)
        try:
            fresh = iter(range(1, 100))

            def remote_written() -> bool:
                server.stream_completion(
                    random_prompt(2 * 128 + 3, seed=next(fresh)), max_tokens=1, timeout=120
                )
                return server.metric("kvbm_tier_write_pages_total", tier="remote") > 0

            wait_for(remote_written, 90, "remote tier used once its server answers")
            assert f"remote tier {url} reachable again" in server.log_path.read_text()

            def link_back() -> bool:  # the scheduler's lookup link, on its own backoff
                server.stream_completion(
                    random_prompt(2 * 128 + 3, seed=next(fresh)), max_tokens=1, timeout=120
                )
                return (
                    server.metric("kvbm_tier_up", tier="remote") == 1
                    and server.metric("kvbm_tier_reconnects_total", tier="remote") == 1
                )

            wait_for(link_back, 90, "remote tier up again and its reconnect counted")
        finally:
            stop_process(lmcache)


def test_demo_shows_a_host_tier_hit(model_dir, capsys):
    from vllm_kvbm.tools import demo

    # Documents of 1600 tokens instead of 3000 (the hit is the point, not its
    # size), with the engine's cache shrunk alike: too small for two of them.
    assert (
        demo.main(
            ["--model", str(MODEL_DIR), "--prompt-tokens", "1600", "--engine-kv-blocks", "16"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "KVBM host hit" in out and "onboarded from host:" in out
    onboarded = int(out.split("onboarded from host:")[1].split(";")[0])
    assert onboarded >= 10, out
