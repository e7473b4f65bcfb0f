"""A ``kvbm-pool`` process for the benchmarks and the GPU check: started to
serve the pool files of a directory on 127.0.0.1, and the served file's
``hello`` (where its slots lie, the pool's NIXL metadata) once it has taken
the file up (bench_peer_read.py, gpu_check_peer.py)."""

from __future__ import annotations

import subprocess
import sys
import time


def start_pool(directory: str, sock: str, port: int, **popen) -> subprocess.Popen:
    """``kvbm-pool`` serving ``directory``'s pool files to peers on
    127.0.0.1:``port``; ``popen``: the caller's stdio and the like."""
    argv = [sys.executable, "-m", "vllm_kvbm.tools.pool", "--dir", directory, "--socket", sock]
    argv += ["--serve-port", str(port), "--serve-host", "127.0.0.1"]
    return subprocess.Popen(argv, **popen)


def pool_hello(link, spec, pool: subprocess.Popen, timeout_s: float) -> tuple[dict, bytes]:
    """The served file's hello, asked again until kvbm-pool has taken the
    file up (it does at start): the reply and the pool's NIXL metadata."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            reply, metadata = link.request(
                {
                    "op": "hello",
                    "file": spec.name,
                    "scope": spec.scope_digest.hex(),
                    "known": ["", -1],
                },
                2.0,
            )
            if reply.get("ok") and metadata:
                return reply, metadata
        except TimeoutError:
            pass
        if pool.poll() is not None:
            raise RuntimeError(f"kvbm-pool exited ({pool.returncode}) before serving the file")
        if time.monotonic() > deadline:
            raise TimeoutError(f"kvbm-pool did not serve the file within {timeout_s:g} s")
        time.sleep(0.2)
