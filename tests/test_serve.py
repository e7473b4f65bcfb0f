"""`vllm serve` with the plugin, as users start it: startup errors and the demo."""

from __future__ import annotations

import pytest

from conftest import MODEL_DIR
from vllm_kvbm.server import kvbm_transfer_config, vllm_server

pytestmark = pytest.mark.timeout(900)

SERVE_ARGS = ["--enforce-eager", "--max-model-len", "2048", "--gpu-memory-utilization", "0.25",
              "--num-gpu-blocks-override", "32"]


@pytest.mark.parametrize("extra,expected", [
    ({"host_cache_sise": "1GiB"},
     ["unknown key 'host_cache_sise'", "did you mean 'host_cache_size'"]),
    ({"host_cache_size": "1KiB"},
     ["host_cache_size: 1024 bytes cannot hold one KV block", "set host_cache_size to at least"]),
])
def test_bad_config_stops_startup_with_a_clear_message(model_dir, extra, expected):
    with pytest.raises(RuntimeError) as err:
        with vllm_server(str(MODEL_DIR), kvbm_transfer_config(**extra), SERVE_ARGS,
                         startup_timeout=300):
            pass
    log = err.value.args[0]
    for text in expected:
        assert text in log, log[-2000:]


def test_demo_shows_a_host_tier_hit(model_dir, capsys):
    from vllm_kvbm import demo

    assert demo.main(["--model", str(MODEL_DIR)]) == 0
    out = capsys.readouterr().out
    assert "KVBM host hit" in out and "onboarded from host:" in out
    onboarded = int(out.split("onboarded from host:")[1].split(";")[0])
    assert onboarded >= 10, out
