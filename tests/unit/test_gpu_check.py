"""benchmarks/gpu_check.py, run on CPU tensors with small sizes: the logic the
GPU machine runs (real KVBMWorker, PageMover and NIXL; vLLM 0.32's layouts)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
CASES = ["flash-attn", "flashinfer-hnd", "packed-blhnc", "mla", "kernel-split"]


def test_gpu_check_passes_on_cpu():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--layers", "3", "--blocks", "24",
         "--heads", "2", "--block-size", "4", "--head-size", "16", "--mla-head-size", "24",
         "--repeats", "1", "--page-blocks", "4"],
        capture_output=True, text=True, timeout=600, cwd="/")  # imports from the repo
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    lines = out.stdout.splitlines()
    assert lines[-1].startswith("gpu_check: all ") and "checks passed" in lines[-1], lines[-1]
    rows = [line.split() for line in lines if line.split()[:1] and line.split()[0] in CASES]
    assert not [r for r in rows if "FAIL" in r]
    for case in CASES:
        text = "\n".join(line for line in lines if line.startswith(case + " "))
        for check in ("host pool exact size", "stores copy the KV after the forward",
                      "loads land after pending kernels", "no transfer failed",
                      "shutdown released NIXL"):
            assert f"{check}" in text and "PASS" in text.split(check)[1].split("\n")[0], \
                (case, check, text)
        assert "offload d2h GB/s" in text and "onboard h2d GB/s" in text
    pages = "\n".join(line for line in lines if line.startswith("pages "))
    for check in ("pages stored whole, one slot each", "pages loaded, the skipped block untouched"):
        assert check in pages and "PASS" in pages.split(check)[1].split("\n")[0], (check, pages)


def test_gpu_check_reports_a_stale_page_as_failed(monkeypatch, capsys):
    """A host page that differs from the KV must fail the run (exit status 1).
    A stale page cannot be produced on CPU (the forward pass is synchronous),
    so one byte of a stored page is flipped before the script compares."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(SCRIPT.parent))
    real = gpu_check.slot_pages_equal

    def stale(pool, lay, kv_cpu, blocks, slots):
        pool[slots[0], 0] ^= 0xFF
        return real(pool, lay, kv_cpu, blocks, slots)

    monkeypatch.setattr(gpu_check, "slot_pages_equal", stale)
    rc = gpu_check.main(["--device", "cpu", "--cases", "flash-attn", "--layers", "2",
                         "--blocks", "8", "--repeats", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 1
    row = next(line for line in lines if "stores copy the KV after the forward" in line)
    assert "FAIL" in row and "3/4 host pages byte-equal" in row, row
    assert "checks FAILED" in lines[-1], lines[-1]
