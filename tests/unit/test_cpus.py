"""KVBM's I/O threads are not pinned to the core of the thread that starts
them (vLLM's CPU backend pins the engine thread to one core)."""

from __future__ import annotations

import os
import threading

import pytest

from vllm_kvbm.cpus import _parse_list, process_cpus


def test_cpu_lists_parse():
    assert _parse_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert _parse_list("5") == {5} and _parse_list("") == set()


def _started_from_a_pinned_thread(start):
    """Runs ``start()`` on a thread pinned to one CPU, as vLLM pins the engine
    thread; returns what it returned."""
    out = {}

    def pinned():
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        out["value"] = start()

    t = threading.Thread(target=pinned)
    t.start()
    t.join()
    return out["value"]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_tier_io_and_disk_reader_threads_run_on_every_cpu_of_the_process(tmp_path):
    from helpers.tier_pages import SMALL, key
    from vllm_kvbm.messages import KVBMWorkerMetadata, TransferJob
    from vllm_kvbm.tiers.disk.store import DiskStore
    from vllm_kvbm.worker.tier_io import TierIO

    import torch

    everyone = os.sched_getaffinity(0)
    assert process_cpus() >= everyone

    store = DiskStore(str(tmp_path), 64 << 20, SMALL, "ns", 0, 1)
    io = TierIO()
    io.add(store)
    try:
        seen = {}

        def spy(target):
            seen[threading.current_thread().name] = os.sched_getaffinity(0)
            return "miss"

        store._get = spy  # records where the reader threads run (each page's read)
        pool = torch.zeros(2, SMALL, dtype=torch.uint8)
        job = TransferJob(1, "R", [0, 1], [0, 1], fetch=[(0, "disk", key(1)), (1, "disk", key(2))])
        meta = KVBMWorkerMetadata()

        def fetch():  # from the engine thread: the pools start their threads here
            io.fetch(job, pool)
            while not io.poll(meta):
                pass

        _started_from_a_pinned_thread(fetch)
        assert {n.rsplit("_", 1)[0] for n in seen} == {"kvbm-disk-read"}
        for name, cpus in seen.items():
            assert cpus == process_cpus(), (name, cpus)
    finally:
        io.close()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_the_lookup_thread_runs_on_every_cpu_of_the_process():
    from vllm_kvbm.scheduler.lookups import BackgroundLookups
    from vllm_kvbm.scheduler.tier_policy import LowerTiers

    lookups = _started_from_a_pinned_thread(lambda: BackgroundLookups(LowerTiers([])))
    tid = lookups._thread.native_id
    deadline = __import__("time").monotonic() + 5
    while os.sched_getaffinity(tid) != process_cpus():
        assert __import__("time").monotonic() < deadline, os.sched_getaffinity(tid)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_process_whose_threads_are_all_pinned_sees_its_parents_cpus():
    # A vLLM CPU worker: OpenMP pins its first thread before any other starts.
    import subprocess
    import sys

    code = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "from vllm_kvbm.cpus import process_cpus; print(sorted(process_cpus()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert set(eval(out)) >= os.sched_getaffinity(0)
