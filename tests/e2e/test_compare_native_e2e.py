"""`kvbm-bench compare` with plain vLLM and vLLM's own CPU offloading
(`--kv-offloading-size`, native backend) on real `vllm serve`s: on the CPU
build vLLM's offloading stops at startup (CUDA/XPU only), and the report
carries the plain row's figures and the offloading row's cause from its log."""

from __future__ import annotations

import json

import pytest

from helpers.engines import MODEL_DIR
from vllm_kvbm.bench.compare import main

pytestmark = pytest.mark.timeout(900)

NATIVE_CAUSE = "Exception: CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"


def test_compare_reports_why_vllm_offloading_does_not_start(model_dir, tmp_path, capsys):
    out = tmp_path / "compare"
    rc = main(["--model", str(MODEL_DIR), "--configs", "vllm", "vllm-offload",
               "--out-dir", str(out), "--num-users", "1", "--num-rounds", "2",
               "--shared-system-prompt", "300", "--user-history-prompt", "100",
               "--answer-len", "4", "--qps", "4", "--engine-kv-blocks", "24",
               "--startup-timeout", "240", "--time", "120", "--request-timeout", "60"])
    text = (out / "report.md").read_text()
    assert rc == 0, text  # the plain configuration ran; the failed one is reported
    assert "| vLLM prefix caching | ok |" in text and " 2/2 |" in text
    plain = json.loads((out / "vllm.summary.json").read_text())
    assert plain["status"] == "ok" and plain["requests"] == 2 and plain["ttft_mean_s"] > 0
    assert f"| vLLM --kv-offloading-size (native) | does not start: {NATIVE_CAUSE} |" in text
    native = json.loads((out / "vllm-offload.summary.json").read_text())
    assert native["status"] == "did not start" and native["reason"] == NATIVE_CAUSE
    # the failed server was stopped and its port freed (compare checks and says so)
    assert "still in use" not in text
    assert "Traceback" not in text
    assert "'kv_offloading_size': 1.0" in (out / "server-vllm-offload.log").read_text()
