"""benchmarks/gpu_check.py's peer-read case (benchmarks/gpu_check_peer.py) on CPU:
a real kvbm-pool process serves pages its child reads over NIXL; a wrong byte
fails the case, and a child past its deadline is killed with its kvbm-pool."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from test_gpu_check import SCRIPT, _import


def _rows(out: str, case: str) -> dict[str, tuple[str, str]]:
    """A case's rows: check -> (PASS/FAIL/info, detail)."""
    rows = {}
    for line in out.splitlines():
        if line.startswith(case + " "):
            what, rest = line[16:].split("  ", 1)
            status, _, detail = rest.strip().partition(" ")
            rows[what.strip()] = (status, detail.strip())
    return rows


def _processes_naming(text: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.mark.timeout(300)
def test_the_peer_read_case_reads_a_real_kvbm_pool_and_says_what_cpu_skips():
    """peer-read on CPU, for real: a kvbm-pool process serves 4 pages, the
    reader's bytes equal the served pages in every round, the GB/s row against
    a raw NIXL READ is printed, pinning and the GPU copy are said skipped, and
    the child, kvbm-pool and the pool file are gone afterwards."""
    t = time.perf_counter()
    out = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--device",
            "cpu",
            "--cases",
            "peer-read",
            "--peer-pages",
            "4",
            "--peer-page-kib",
            "256",
            "--repeats",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "gpu_check: all 3 checks passed" in out.stdout.splitlines()[-1], out.stdout
    rows = _rows(out.stdout, "peer-read")
    assert rows["pages written into the pool file"] == ("PASS", "4/4 stored")
    status, detail = rows["peer read, bytes equal the served pages"]
    assert status == "PASS" and detail.startswith(
        "4/4 pages 'ok' and byte-equal in the worst of 3 rounds, read into pageable host memory"
    ), detail
    status, detail = rows["peer read GB/s (vs raw NIXL READ)"]
    assert status == "info" and re.match(
        r"\d+\.\d\d / \d+\.\d\d \(peer/raw \d+\.\d\d; 1 MiB of "
        r"pages, raw 1 MiB in one READ; medians of 2 rounds",
        detail,
    ), detail
    assert rows["host memory"] == ("info", "pageable: no CUDA device (CPU run), pinning skipped")
    import vllm_kvbm.tiers.peer.store as peer_store  # READ in place where it can be

    assert rows["reader path"][1].startswith(
        "READ in place"
        if hasattr(peer_store.PeerStore, "reads_into")
        else "through the reader's landing slots"
    ), rows["reader path"]
    assert rows["GPU copy"] == ("info", "skipped: no CUDA device (CPU run)")
    assert rows["child finished"] == ("PASS", "exit status 0")
    pool = rows["pool"][1]
    pid = int(pool.split("(pid ")[1].split(")")[0])
    path = pool.split(" in ")[1].split(" served by ")[0]
    assert not os.path.exists(f"/proc/{pid}") and not os.path.exists(os.path.dirname(path))
    assert time.perf_counter() - t < 120


def test_a_wrong_byte_from_the_peer_fails_the_peer_read_case(monkeypatch, capsys, tmp_path):
    """The comparison with the served pages can fail: kvbm-pool serves a page
    with one byte changed (its checksum made for the changed bytes, so the
    reader calls it 'ok'), and the bytes-equal row fails naming 3 of 4."""
    _import("gpu_check", SCRIPT.parent)
    peer = sys.modules["gpu_check_peer"]
    from vllm_kvbm.tiers.pool.store import PoolStore

    real = PoolStore.put

    def put(self, key, page):
        if key == (2).to_bytes(4, "little") * 8:
            page = page.clone()
            page[100] ^= 0xFF
        return real(self, key, page)

    monkeypatch.setattr(PoolStore, "put", put)
    rc = peer.child(
        [
            "--device",
            "cpu",
            "--dir",
            str(tmp_path),
            "--pages",
            "4",
            "--page-kib",
            "64",
            "--repeats",
            "1",
        ]
    )
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "peer read, bytes equal" in line)
    assert rc == 0 and "\tFAIL\t3/4 pages 'ok' and byte-equal" in row, out
    assert "GPU copy" not in out  # nothing after a failed read


# kvbm-pool must be serving before the 30 s deadline: under the suite's load its
# start alone took longer, so the test runs with the tests that bound a wait, alone.
@pytest.mark.timing
def test_a_peer_read_child_past_its_deadline_is_killed_with_its_kvbm_pool(
    monkeypatch, capsys, tmp_path
):
    """A child still running at its deadline (as under a NIXL or UCX hang;
    here: rounds without end) is killed with the kvbm-pool it started, within
    the deadline; its failed row says so, and its pool file is removed."""
    gpu_check = _import("gpu_check", SCRIPT.parent)
    peer = sys.modules["gpu_check_peer"]
    monkeypatch.setattr(peer, "pool_dir", lambda need: str(tmp_path))
    t = time.perf_counter()
    rc = gpu_check.main(
        [
            "--device",
            "cpu",
            "--cases",
            "peer-read",
            "--peer-pages",
            "4",
            "--peer-page-kib",
            "64",
            "--repeats",
            "1000000",
            "--peer-timeout-s",
            "30",
        ]
    )
    out = capsys.readouterr().out
    assert time.perf_counter() - t < 60
    rows = _rows(out, "peer-read")
    assert "pool" in rows, out  # kvbm-pool was serving when the child was killed
    assert rc == 1 and rows["child finished"][0] == "FAIL", out
    assert rows["child finished"][1].startswith("killed after 30 s"), out
    deadline = time.monotonic() + 10  # SIGKILL is sent; the kernel reaps
    while _processes_naming(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _processes_naming(str(tmp_path))
    assert not list(tmp_path.iterdir())  # the pool file's directory removed
