"""KVBM's I/O threads are not pinned to the core of the thread that starts
them (vLLM's CPU backend pins the engine thread to one core)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from vllm_kvbm.cpus import _parse_list, process_cpus, widened_thread


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


def _threads_started_by(start):
    """(what ``start()`` returned on a pinned thread, the ids of the threads
    started meanwhile)."""
    before = set(os.listdir("/proc/self/task"))
    value = _started_from_a_pinned_thread(start)
    return value, {int(t) for t in set(os.listdir("/proc/self/task")) - before}


def _all_widened(tids: set[int]) -> None:
    deadline = time.monotonic() + 10  # a thread may widen itself first thing
    while pinned := {t: cpus for t in tids if (cpus := _cpus_of(t)) not in (None, process_cpus())}:
        assert time.monotonic() < deadline, pinned
        time.sleep(0.01)


def _cpus_of(tid: int) -> set[int] | None:
    """The thread's CPUs; None once it has ended (a short-lived setup thread)."""
    try:
        return os.sched_getaffinity(tid)
    except (ProcessLookupError, OSError):
        return None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_no_thread_of_the_peer_server_is_bound_to_the_starting_threads_core():
    """Its own thread and the native ones its setup starts (ZMQ's I/O thread,
    which accepts peers' connections; UCX's async thread): on that one core a
    busy machine left a peer's connection unaccepted for 10 s (measured)."""
    from vllm_kvbm.tiers.peer.server import PeerServer
    from vllm_kvbm.tools.server import free_port

    server, started = _threads_started_by(lambda: PeerServer("127.0.0.1", free_port()))
    try:
        assert server._thread.native_id in started and len(started) >= 3  # + ZMQ's, UCX's
        _all_widened(started)
    finally:
        server.close()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_no_thread_of_the_peer_reader_is_bound_to_the_starting_threads_core():
    from test_peer_reads import reader

    store, started = _threads_started_by(reader)  # its NIXL agent starts UCX's thread
    try:
        assert started
        _all_widened(started)
    finally:
        store.close()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_tier_event_loops_and_worker_threads_run_on_every_cpu_of_the_process():
    """The remote and disk tiers' event loops (their network and file I/O),
    the directory's and the weights digest's threads: widened_thread."""
    from vllm_kvbm.tiers.lmcache_store import start_loop, stop_loop

    (loop, thread), started = _threads_started_by(lambda: start_loop("kvbm-test-io"))
    try:
        assert thread.native_id in started
        _all_widened({thread.native_id})
    finally:
        stop_loop(loop, thread, 5.0)
    stop = threading.Event()
    t, _ = _threads_started_by(lambda: _started(widened_thread(stop.wait, "kvbm-test", 30)))
    try:
        _all_widened({t.native_id})
    finally:
        stop.set()


def _started(t: threading.Thread) -> threading.Thread:
    t.start()
    return t


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_the_page_movers_copy_thread_stays_within_a_taskset_placement():
    """Widened to the process's CPUs, not to every CPU of the machine: an
    operator's ``taskset`` (no cpuset behind it) is kept."""
    import subprocess

    one = min(os.sched_getaffinity(0))
    code = (
        "import os, threading; from vllm_kvbm.worker.page_mover import _CopyThread; "
        "t = _CopyThread(object(), 'kvbm-test'); "
        "import time; time.sleep(0.5); "
        "print(sorted(os.sched_getaffinity(t._thread.native_id))); t.stop()"
    )
    # Through sh, so that the process's parent is not a python that
    # process_cpus would count as part of the engine.
    out = subprocess.run(
        ["sh", "-c", f'taskset -c {one} "$0" -c "$1"; :', __import__("sys").executable, code],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert eval(out) == [one]


def _spare_in_a_pinned_child(env: dict[str, str]) -> set[int]:
    """spare_cpus() in a child pinned to one CPU, as vLLM pins a worker's
    engine thread; its parent (this python) keeps the process's CPUs."""
    import subprocess
    import sys

    code = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "from vllm_kvbm.cpus import spare_cpus; print(sorted(spare_cpus()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env={**{k: v for k, v in os.environ.items() if k != "VLLM_CPU_OMP_THREADS_BIND"}, **env},
    ).stdout
    return set(eval(out))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_spare_cpus_are_those_no_openmp_thread_is_pinned_to():
    cpus = os.sched_getaffinity(0)
    one, other = min(cpus), max(cpus)
    # a core reserved: every other CPU of the process is spare
    assert _spare_in_a_pinned_child({}) == cpus - {one}
    # a binding that names every core: none is
    every = ",".join(map(str, sorted(cpus)))
    assert _spare_in_a_pinned_child({"VLLM_CPU_OMP_THREADS_BIND": every}) == set()
    # another rank's core (tensor parallel: "0|1") is not spare either
    bind = f"{one}|{other}"
    assert _spare_in_a_pinned_child({"VLLM_CPU_OMP_THREADS_BIND": bind}) == cpus - {one, other}


def test_no_cpu_is_spare_for_a_thread_that_is_not_pinned():
    # vLLM's binding off (nobind): nothing says where the forward pass runs.
    from vllm_kvbm.cpus import spare_cpus

    result: list[set[int]] = []
    t = widened_thread(lambda: result.append(spare_cpus()), "kvbm-test")
    t.start()
    t.join(10)
    assert result == [set()]
