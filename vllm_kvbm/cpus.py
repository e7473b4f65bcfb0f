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
    for _, allowed in threads(pids):
        cpus |= allowed
    return cpus


def threads(pids: list[int]):
    """(OS name, allowed CPUs) of every thread of ``pids``; threads that
    end meanwhile are skipped. KVBM's pinned threads are named
    ``OS_THREAD_PREFIX``...: they are not vLLM's OpenMP threads."""
    for status in [path for pid in pids for path in glob.glob(f"/proc/{pid}/task/*/status")]:
        try:
            with open(status) as f:
                fields = dict(x.split(":", 1) for x in f if ":" in x)
        except OSError:
            continue
        yield fields.get("Name", "").strip(), _parse_list(fields.get("Cpus_allowed_list", ""))


def spare_cpus() -> set[int]:
    """CPUs of this process (``process_cpus``) that no OpenMP thread of vLLM
    runs on: the cores vLLM keeps out of the forward pass
    (``VLLM_CPU_NUM_OF_RESERVED_CPU``, or a ``VLLM_CPU_OMP_THREADS_BIND``
    that leaves some out). vLLM pins each OpenMP thread to one core, so the
    cores taken are those some thread of this process or of a sibling worker
    (tensor parallel ranks: the same parent and executable) is pinned to
    alone, and those the binding names. Empty when the calling thread (vLLM's
    engine thread, at KV cache registration) is not pinned: nothing tells
    which cores the forward pass uses."""
    try:
        mine = os.sched_getaffinity(0)
    except (OSError, AttributeError):
        return set()
    allowed = process_cpus()
    if not mine < allowed:
        return set()
    taken = set(mine)
    parent = os.getppid()
    pids = [os.getpid()]
    if _same_executable(parent):
        pids += [pid for pid in _children(parent) if pid != os.getpid() and _same_executable(pid)]
    for name, cpus in threads(pids):
        # KVBM's own (a layer copy thread) is not OpenMP's
        if len(cpus) == 1 and not name.startswith(OS_THREAD_PREFIX):
            taken |= cpus
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    if bind and bind[0].isdigit():
        try:
            for rank in bind.split("|"):
                taken |= _parse_list(rank)
        except ValueError:
            pass  # vLLM refuses it itself
    return allowed - taken


# The OS-level name (``/proc/.../comm``) of threads KVBM pins itself: what
# reads a process's OpenMP cores from its pinned threads skips them.
OS_THREAD_PREFIX = "kvbm"


def name_os_thread(name: str) -> None:
    """Names the calling thread for the OS (15 bytes at most), as ``top -H``
    and /proc show it; Python's thread names stay inside Python."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _children(parent: int) -> list[int]:
    pids = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                # "pid (comm) state ppid ...": comm may hold spaces and parentheses
                fields = f.read().rpartition(")")[2].split()
            if int(fields[1]) == parent:
                pids.append(int(stat.split("/")[2]))
        except (OSError, ValueError, IndexError):
            continue
    return pids


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
