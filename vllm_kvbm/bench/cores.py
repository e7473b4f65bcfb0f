"""The cores a vLLM engine's OpenMP threads run on, read from its processes.

vLLM CPU (0.32, ``vllm/utils/ompmultiprocessing.py``) binds each worker's
OpenMP threads to ``VLLM_CPU_OMP_THREADS_BIND`` ("auto" by default) and, with
"auto", keeps ``reserve_cpu_num`` cores free for the frontend: one per rank,
plus one more per rank for an engine with a ``kv_transfer_config``. When the
machine has no more cores than that, nothing is reserved. On 2 cores a plain
engine gets core 0 and a KVBM engine cores 0 and 1: twice the compute for the
same prefill. Every comparison here therefore runs each configuration with the
same binding environment (``fair_cpu_env``) and checks the running engine
(``check_equal``).

The cores are read from the live processes (psutil): a server's worker
processes (``VLLM::Worker...``; an in-process engine's own threads otherwise),
and in each the CPUs its threads are pinned to. A worker process's own
``cpu_affinity()`` is its first thread's, which vLLM pins to the first OpenMP
core only, so every thread is read: each OpenMP thread is pinned to one core;
threads pinned to several (KVBM's I/O threads widen themselves to the whole
machine, threads started before the binding keep it) are not OpenMP's. A
process with no thread pinned to one core (``VLLM_CPU_OMP_THREADS_BIND=nobind``,
a GPU server) runs on its own affinity.

    python -m vllm_kvbm.bench.cores PID [PID ...]   # print each; exit 1 if they differ
"""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit

import psutil

from vllm_kvbm.cpus import OS_THREAD_PREFIX, threads

BIND_ENV = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")


@dataclass(frozen=True)
class Binding:
    cores: tuple[tuple[int, ...], ...]  # per worker process (rank order): its OpenMP cores
    reserved: tuple[int, ...] = ()  # cores the server may use that no worker took

    @property
    def threads(self) -> int:
        return sum(len(c) for c in self.cores)

    def describe(self) -> str:
        ranks = " | ".join(",".join(map(str, c)) for c in self.cores) or "none"
        return f"cores {ranks} ({self.threads} OMP thread{'s' * (self.threads != 1)})"


def fair_cpu_env(environ: dict | None = None, reserved: int = 1) -> dict[str, str]:
    """The binding environment given to every configuration: the caller's own
    VLLM_CPU_* settings if it has any, else ``reserved`` cores kept for the
    frontend whatever the connector (what vLLM gives a plain engine)."""
    environ = os.environ if environ is None else environ
    mine = {k: environ[k] for k in BIND_ENV if environ.get(k)}
    return mine or {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(reserved)}


def _title(proc: psutil.Process) -> str:
    try:
        return (proc.cmdline() or [""])[0]
    except psutil.Error:
        return ""


def pinned_cores(proc: psutil.Process) -> tuple[int, ...]:
    """The cores ``proc``'s threads are pinned to one by one (its OpenMP
    threads': not KVBM's layer store thread, pinned to a core OpenMP left
    free), else the process's affinity."""
    cores: set[int] = set()
    for name, cpus in threads([proc.pid]):
        if len(cpus) == 1 and not name.startswith(OS_THREAD_PREFIX):
            cores.update(cpus)
    return tuple(sorted(cores)) if cores else tuple(sorted(proc.cpu_affinity()))


def process_binding(pid: int) -> Binding | None:
    """The binding of the engine whose process tree starts at ``pid`` (a
    ``vllm serve``, or a process running an offline engine), or None when it
    is gone or not readable."""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
        for kind in ("::Worker", "::EngineCore"):
            procs = sorted((p for p in tree if kind in _title(p)), key=lambda p: (_title(p), p.pid))
            if procs:
                break
        else:
            procs = [root]
        cores = tuple(pinned_cores(p) for p in procs)
        allowed = set(root.cpu_affinity())
    except psutil.Error:
        return None
    used = {c for rank in cores for c in rank}
    return Binding(cores, tuple(sorted(allowed - used)))


def listening_pid(url: str) -> int | None:
    """The process of this machine listening on ``url``'s port when its host
    is this machine, else None (a server elsewhere: its cores are not read)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if parts.hostname not in ("localhost", "127.0.0.1", "::1", "0.0.0.0"):
        return None
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return None
    return next(
        (c.pid for c in conns if c.status == psutil.CONN_LISTEN and c.pid and c.laddr.port == port),
        None,
    )


def check_equal(bindings: dict[str, Binding | None], unknown_ok: bool = False) -> str:
    """'' when every configuration ran its OpenMP threads on the same cores;
    otherwise a message naming each one's cores. With ``unknown_ok`` a
    configuration whose cores could not be read (a server on another machine)
    is left out of the check."""
    known = {n: b for n, b in bindings.items() if b is not None or not unknown_ok}
    seen = {name: b.cores if b else None for name, b in known.items()}
    if len(set(seen.values())) <= 1 and None not in seen.values():
        return ""
    return "the configurations did not run on the same cores: " + "; ".join(
        f"{name}: {b.describe() if b else 'unknown (its worker processes were not found)'}"
        for name, b in known.items()
    )


@contextmanager
def teed_output(path: str | os.PathLike):
    """Copies what this process and its children write to stdout and stderr
    into ``path`` too, through ``tee`` (what C libraries print, such as UCX's
    protocol choice in benchmarks/gpu_check_paths.py). Keep every child's
    whole life inside: a child writing to a closed pipe would die."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    tee = subprocess.Popen(["tee", "-a", str(path)], stdin=subprocess.PIPE, stdout=saved[0])
    os.dup2(tee.stdin.fileno(), 1)
    os.dup2(tee.stdin.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        tee.stdin.close()
        try:
            tee.wait(timeout=30)
        except subprocess.TimeoutExpired:
            tee.kill()
        for fd in saved:
            os.close(fd)


def main(argv: list[str] | None = None) -> int:
    pids = list(sys.argv[1:] if argv is None else argv)
    if not pids or not all(p.isdigit() for p in pids):
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    bindings = {p: process_binding(int(p)) for p in pids}
    for p, b in bindings.items():
        print(f"{p}: {b.describe() if b else 'no such process'}")
    problem = check_equal(bindings)
    if problem:
        print(f"NOT COMPARABLE: {problem}", file=sys.stderr)
    return 1 if problem else 0


if __name__ == "__main__":
    sys.exit(main())
