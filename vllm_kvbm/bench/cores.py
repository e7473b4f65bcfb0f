"""The cores and OpenMP threads a vLLM CPU engine ran on, read from its log.

vLLM CPU (0.32, ``vllm/utils/ompmultiprocessing.py``) binds the worker's OpenMP
threads to ``VLLM_CPU_OMP_THREADS_BIND`` ("auto" by default) and, with "auto",
keeps ``reserve_cpu_num`` cores free for the frontend: one per rank, plus one
more per rank for an engine with a ``kv_transfer_config``. When the machine has
no more cores than that, nothing is reserved. On 2 cores a plain engine gets
``core ids=[0]`` and a KVBM engine ``[0, 1]``: twice the compute for the same
prefill. Every comparison here therefore runs each configuration with the same
binding environment (``fair_cpu_env``) and checks the log (``check_equal``).
The worker's OMP_NUM_THREADS is the number of its core ids. Offline benchmarks
read their engine's log through ``teed_output``.

    python -m vllm_kvbm.bench.cores LOG [LOG ...]   # print each; exit 1 if they differ
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

BIND_ENV = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass(frozen=True)
class Binding:
    bind: str                    # VLLM_CPU_OMP_THREADS_BIND as the engine saw it
    reserve: int                 # reserve_cpu_num
    cores: tuple[tuple[int, ...], ...]  # per local rank: the OpenMP threads' cores
    reserved: tuple[int, ...]

    @property
    def threads(self) -> int:
        return sum(len(c) for c in self.cores)

    def describe(self) -> str:
        ranks = " | ".join(",".join(map(str, c)) for c in self.cores) or "none (nobind)"
        return f"cores {ranks} ({self.threads} OMP thread{'s' * (self.threads != 1)})"


def fair_cpu_env(environ: dict | None = None, reserved: int = 1) -> dict[str, str]:
    """The binding environment given to every configuration: the caller's own
    VLLM_CPU_* settings if it has any, else ``reserved`` cores kept for the
    frontend whatever the connector (what vLLM gives a plain engine)."""
    environ = os.environ if environ is None else environ
    mine = {k: environ[k] for k in BIND_ENV if environ.get(k)}
    return mine or {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(reserved)}


def parse_binding(text: str) -> Binding | None:
    """The OpenMP binding info vLLM logged at engine start (the last one in
    ``text``), or None when the log has none."""
    at = text.rfind("OpenMP thread binding info")
    if at < 0:
        return None
    block = _ANSI.sub("", text[at:])
    end = block.find("reserved_cpus=")
    block = block[:block.find("\n", end) if end >= 0 else len(block)]
    bind = re.search(r"VLLM_CPU_OMP_THREADS_BIND='([^']*)'", block)
    reserve = re.search(r"reserve_cpu_num=(\d+)", block)
    cores = re.findall(r"local_rank=\d+, core ids=\[([\d, ]*)\]", block)
    reserved = re.search(r"reserved_cpus=\[([\d, ]*)\]", block)
    if bind is None or reserve is None:
        return None

    def ids(s: str) -> tuple[int, ...]:
        return tuple(int(x) for x in s.replace(" ", "").split(",") if x)

    return Binding(bind.group(1), int(reserve.group(1)), tuple(ids(c) for c in cores),
                   ids(reserved.group(1)) if reserved else ())


def read_binding(path: str | os.PathLike) -> Binding | None:
    try:
        return parse_binding(Path(path).read_text(errors="replace"))
    except OSError:
        return None


def check_equal(bindings: dict[str, Binding | None]) -> str:
    """'' when every configuration ran its OpenMP threads on the same cores;
    otherwise a message naming each one's cores."""
    seen = {name: b.cores if b else None for name, b in bindings.items()}
    if len(set(seen.values())) <= 1 and None not in seen.values():
        return ""
    return "the configurations did not run on the same cores: " + "; ".join(
        f"{name}: {b.describe() if b else 'unknown (no OpenMP binding line in its log)'}"
        for name, b in bindings.items())


@contextmanager
def teed_output(path: str | os.PathLike):
    """Copies what this process and its children (an offline engine's core)
    write to stdout and stderr into ``path`` too, through ``tee``: the engine
    logs its binding there. Keep the engine's whole life inside: a child
    writing to a closed pipe would die."""
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
    paths = list(sys.argv[1:] if argv is None else argv)
    if not paths:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    bindings = {p: read_binding(p) for p in paths}
    for p, b in bindings.items():
        print(f"{p}: {b.describe() if b else 'no OpenMP binding line'}")
    problem = check_equal(bindings)
    if problem:
        print(f"NOT COMPARABLE: {problem}", file=sys.stderr)
    return 1 if problem else 0


if __name__ == "__main__":
    sys.exit(main())
