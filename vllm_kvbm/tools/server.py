"""Start and stop a real ``vllm serve`` on 127.0.0.1, and talk to it.

Used by the demo, the benchmarks and the tests; every wait is bounded and the
server is always stopped, including its engine-core children.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from vllm_kvbm.tools.compute_dtype import compute_dtype


def _ephemeral_ports() -> tuple[int, int]:
    """The range the kernel takes a connection's local port from."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(span: int = 1) -> int:
    """A port on which ``span`` consecutive ports are free now, picked below the
    kernel's ephemeral range: a port the kernel hands out is also what any
    outgoing connection on the machine may take before the caller binds it (a
    server of the tests then failed with "Address already in use")."""
    lo, hi = _ephemeral_ports()
    top = lo - span if lo - span > 10000 else 65535 - span
    bottom = 10000 if top < lo else hi + 1
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(bottom, top)
        if all(_bindable(p) for p in range(port, port + span)):
            return port
    raise RuntimeError(f"no {span} free consecutive ports in {bottom}-{top}")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def kvbm_transfer_config(**extra) -> dict:
    from vllm_kvbm.plugin import CONNECTOR_MODULE, CONNECTOR_NAME

    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


@dataclass
class Server:
    url: str
    model: str
    process: subprocess.Popen
    log_path: Path

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as resp:
            return resp.read().decode()

    def metric(self, name: str, **labels: str) -> float:
        """Sum of one metric's samples on /metrics: of every label set, or of
        those with ``labels`` (``tier="disk"``)."""
        return self.metric_total(self.metrics(), name, **labels)

    @staticmethod
    def metric_total(text: str, name: str, **labels: str) -> float:
        """Sum of the samples named ``name`` (e.g. ``kvbm_x_total``, ``h_count``)
        having ``labels``, in a Prometheus text exposition, read by
        prometheus_client's parser."""
        from prometheus_client.parser import text_string_to_metric_families

        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and labels.items() <= sample.labels.items()
        )

    def stream_completion(
        self, prompt, max_tokens: int = 16, timeout: float = 600
    ) -> tuple[float, float, str]:
        """Greedy streaming completion: (ttft seconds, total seconds, text)."""
        from vllm_kvbm.tools.completions import stream_sync

        out = stream_sync(self.url, self.model, prompt, max_tokens, timeout)
        return out.ttft, out.total, "".join(out.text)


@contextmanager
def vllm_server(
    model: str,
    kv_transfer_config: dict | None = None,
    extra_args: list[str] | None = None,
    env: dict | None = None,
    log_path: str | os.PathLike | None = None,
    startup_timeout: float = 600,
    port: int | None = None,
    on_wait: Callable[[float, str], None] | None = None,
) -> Iterator[Server]:
    """A running ``vllm serve``, stopped on exit. ``on_wait(seconds, line)``
    is called about once a second while it starts, with the last line of its
    log (a caller's progress display)."""
    port = port or free_port()
    extra_args = list(extra_args or [])
    if not any(a == "--dtype" or a.startswith("--dtype=") for a in extra_args):
        # float32 where bf16 would be emulated (tools/compute_dtype.py)
        extra_args += ["--dtype", compute_dtype()]
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra_args,
    ]
    if kv_transfer_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    log_path = Path(log_path or f"/tmp/vllm-serve-{port}.log")
    log = open(log_path, "w")
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )
    server = Server(f"http://127.0.0.1:{port}", model, proc, log_path)
    try:
        wait_for_http(
            f"{server.url}/health",
            proc,
            startup_timeout,
            "vllm serve",
            on_exit=lambda: f"errors in {log_path}:\n{_errors(log_path)}",
            on_timeout=lambda: f"log: {log_path}\n{_tail(log_path)}",
            on_poll=on_wait and (lambda s: on_wait(s, last_line(log_path))),
        )
        yield server
    finally:
        _stop(proc)
        log.close()


def wait_for_http(
    url: str,
    proc: subprocess.Popen,
    timeout: float,
    what: str,
    on_exit=lambda: "",
    on_timeout=lambda: "",
    on_poll=None,
) -> None:
    """Waits until ``url`` answers 200, failing early if ``proc`` exits;
    ``on_poll(seconds waited)`` between tries."""
    start = time.monotonic()
    deadline = start + timeout
    while True:
        if on_poll is not None:
            on_poll(time.monotonic() - start)
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} during startup; {on_exit()}")
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {timeout:.0f} s; {on_timeout()}")
        time.sleep(0.5)


def _stop(proc: subprocess.Popen, grace: float = 30) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=grace)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)
    # a server that exited on its own (a failed start) may leave engine-core or
    # worker children in its session, holding memory and ports
    _kill_group(proc.pid)


def _kill_group(pgid: int, grace: float = 5, timeout: float = 10) -> None:
    """Gives what is left of a process group ``grace`` seconds to exit (it got
    the leader's SIGINT), then SIGKILLs it and waits (bounded) until none of it
    runs; zombies count as gone (whoever adopted them reaps them)."""
    deadline = time.monotonic() + grace
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    deadline = time.monotonic() + timeout
    while group_alive(pgid) and time.monotonic() < deadline:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.1)


def group_alive(pgid: int) -> bool:
    """Whether a process of group pgid is still running (not a zombie)."""
    try:
        pids = [d for d in os.listdir("/proc") if d.isdigit()]
    except OSError:  # no /proc: ask the kernel
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when nothing listens on host:port (a stopped server's port)."""
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, port)) != 0


def wait_port_free(port: int, timeout: float = 30, host: str = "127.0.0.1") -> bool:
    deadline = time.monotonic() + timeout
    while not port_free(port, host):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _errors(path: Path, limit: int = 12) -> str:
    """The distinct exception lines of a log: where the root cause is named."""
    seen: list[str] = []
    for line in path.read_text(errors="replace").splitlines():
        text = line.split("] ", 1)[-1].strip()
        if ("Error:" in text or "Exception:" in text) and text not in seen:
            seen.append(text)
    return "\n".join(seen[:limit]) or _tail(path)


def last_line(path: Path, width: int = 100) -> str:
    """The last non-empty line of a log, without vLLM's level, time and
    source prefix, cut to ``width``: what a server is doing as it starts."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        text = re.sub(r"\x1b\[[0-9;]*m", "", line).strip()
        text = re.sub(
            r"^(\([\w ]+ pid=\d+\)\s*)?(\w+ \d\d-\d\d \d\d:\d\d:\d\d "
            r"\[[^\]]*\]\s*)?",
            "",
            text,
        )
        if text:
            return text if len(text) <= width else text[: width - 3] + "..."
    return ""


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def start_lmcache_server(
    port: int, host: str = "127.0.0.1", timeout: float = 60
) -> subprocess.Popen:
    """LMCache's cache server (the remote tier), listening when this returns."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmcache.v1.server", host, str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"lmcache server exited with {proc.returncode} at startup")
            time.sleep(0.3)
    stop_process(proc)
    raise TimeoutError(f"lmcache server did not listen on {host}:{port} within {timeout:.0f} s")


def stop_process(proc: subprocess.Popen) -> None:
    """Kills a process started with start_new_session=True, and its children."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


def freeze_process(proc: subprocess.Popen, what: str, timeout: float = 5.0) -> None:
    """SIGSTOPs a server (a frozen-server fault) and waits until every one of
    its threads has stopped; SIGCONT thaws it."""
    proc.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{proc.pid}/task"):
            try:
                with open(f"/proc/{proc.pid}/task/{task}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                pass
        if states and all(st in "tT" for st in states):
            return
        time.sleep(0.01)
    raise RuntimeError(f"{what} did not stop")
