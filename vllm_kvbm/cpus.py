"""Which CPUs KVBM's own threads (tier I/O, lookups) run on.

vLLM's CPU backend binds each OpenMP thread to one core, the engine thread
included (``VLLM_CPU_OMP_THREADS_BIND``, or the automatic binding that
leaves a core in reserve). A thread inherits the affinity of the thread that
starts it, so KVBM's I/O threads, started from the engine thread, shared its
one core with the forward pass while the reserved core sat idle. Each of
them widens itself, first thing, to every CPU any thread of the process, or
of its parent, may run on: the process's own placement (``taskset``,
``numactl``, a cpuset) is kept, vLLM's per-thread pinning is not inherited.
The parent counts because in a worker process every thread may be pinned
(OpenMP binds the first thread before any other starts): its engine-core
parent, which vLLM does not pin, still has the process's placement. Only a
parent running the same executable (the Python that started this one):
a shell's placement is not this process's.
"""

from __future__ import annotations

import glob
import logging
import os

logger = logging.getLogger(__name__)


def process_cpus() -> set[int]:
    """The union of the CPUs every thread of this process and of its parent
    may run on."""
    pids = [os.getpid()]
    if _same_executable(os.getppid()):
        pids.append(os.getppid())
    cpus: set[int] = set()
    for status in [path for pid in pids for path in glob.glob(f"/proc/{pid}/task/*/status")]:
        try:
            with open(status) as f:
                line = next((x for x in f if x.startswith("Cpus_allowed_list:")), "")
        except OSError:
            continue  # the thread ended meanwhile
        cpus |= _parse_list(line.partition(":")[2])
    return cpus


def _same_executable(pid: int) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/exe") == os.readlink("/proc/self/exe")
    except OSError:  # gone, not ours to read, or no /proc
        return False


def _parse_list(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def widen_thread_affinity() -> None:
    """Lets the calling thread run on every CPU of the process (see above);
    a ThreadPoolExecutor initializer or a thread's first call."""
    try:
        cpus = process_cpus()
        if cpus and cpus != os.sched_getaffinity(0):
            os.sched_setaffinity(0, cpus)
    except (OSError, ValueError, AttributeError) as e:  # not Linux, or refused: keep as is
        logger.debug("KVBM: thread affinity left as it is: %s", e)


def run_widened(fn, *args):
    """``fn(*args)`` on a short-lived thread widened first, its result (or
    its exception) returned here. For setup that starts native threads
    (ZMQ's I/O thread, UCX's async thread): they inherit the affinity of the
    thread that starts them, and on vLLM's worker thread that is one core,
    where a busy machine can hold a peer's connection unaccepted for
    seconds (measured: 10 s with the core shared by the forward pass and
    other processes)."""
    import threading
    from concurrent.futures import Future

    done: Future = Future()

    def run() -> None:
        widen_thread_affinity()
        try:
            done.set_result(fn(*args))
        except BaseException as err:  # noqa: BLE001 - re-raised on the caller's thread
            done.set_exception(err)

    t = threading.Thread(target=run, name="kvbm-setup", daemon=True)
    t.start()
    t.join()
    return done.result()


def widened_thread(target, name: str, *args):
    """A daemon thread (not started) that widens itself, then runs
    ``target(*args)``: for every thread KVBM starts in a worker, where the
    thread starting it is vLLM's, pinned to one core."""
    import threading

    def run() -> None:
        widen_thread_affinity()
        target(*args)

    return threading.Thread(target=run, name=name, daemon=True)
