"""An engine's worker in a process of its own, as far as the pool goes: it
attaches to kvbm-pool on --socket (or keeps its own pool file when it cannot,
serving it on --serve-port when given), writes pages 1..--pages, prints
``wrote <path>``, and holds the file until killed or its stdin closes.

    python tests/helpers/pool_engine.py --dir D --socket S --page-bytes N --pages K
"""

from __future__ import annotations

import argparse
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
NS, SECRET = "ns-peer", b"k" * 32


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--socket", required=True)
    p.add_argument("--page-bytes", type=int, required=True)
    p.add_argument("--pages", type=int, required=True)
    p.add_argument("--capacity", type=int, required=True)
    p.add_argument("--serve-port", type=int, default=None)
    p.add_argument("--layout", default="L")
    args = p.parse_args()
    sys.path.insert(0, str(HERE.parent))
    from helpers.tier_pages import key, page
    from vllm_kvbm.config import load_config
    from vllm_kvbm.tiers.page_codec import PageCodec
    from vllm_kvbm.tiers.pool.attach import open_engine_pool
    from vllm_kvbm.tiers.pool.pool_file import PoolSpec
    from vllm_kvbm.tiers.pool.store import PoolStore

    extra = {"pool_cache_size": args.capacity, "pool_dir": args.dir, "pool_socket": args.socket}
    if args.serve_port is not None:
        extra.update(pool_serve_port=args.serve_port, pool_serve_host="127.0.0.1")
    config = load_config(extra, environ={})
    spec = PoolSpec.for_worker(args.dir, NS, args.page_bytes, 0, 1, args.layout, args.capacity)
    pool, server = open_engine_pool(config, spec, 0)
    store = PoolStore(pool, PageCodec(NS, args.page_bytes, SECRET, layout=args.layout), server)
    for i in range(1, args.pages + 1):
        assert store.put(key(i), page(i, args.page_bytes))
    print(f"wrote {pool.path} {'own' if server is not None else 'attached'}", flush=True)
    try:
        sys.stdin.read()
    finally:
        store.close()


def start(
    directory: str,
    socket_path: str,
    page_bytes: int,
    pages: int,
    capacity: int,
    serve_port: int | None = None,
    layout_fp: str = "L",
    env: dict | None = None,
    timeout: float = 60.0,
) -> tuple[subprocess.Popen, str]:
    """The process, once it wrote its pages, and its line after ``wrote``."""
    cmd = [
        sys.executable,
        str(HERE / "pool_engine.py"),
        "--dir",
        directory,
        "--socket",
        socket_path,
        "--page-bytes",
        str(page_bytes),
        "--pages",
        str(pages),
        "--capacity",
        str(capacity),
        "--layout",
        layout_fp,
    ]
    if serve_port is not None:
        cmd += ["--serve-port", str(serve_port)]
    # its log in a file, not a pipe nobody reads while it runs (a full pipe blocks it)
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(HERE.parents[1]), **(env or {})},
    )
    try:
        return proc, wait_line(proc, "wrote ", timeout)
    except RuntimeError as err:
        log.seek(0)
        raise RuntimeError(f"{err}: {log.read()[-2000:]}") from None


def wait_line(proc: subprocess.Popen, prefix: str, timeout: float) -> str:
    """The rest of the first line of ``proc``'s stdout that starts with
    ``prefix`` (other lines, NIXL's log among them, skipped); the process is
    killed if none comes within ``timeout``. Lines are read on a thread: a
    select on the pipe misses lines already in the reader's buffer."""
    lines: queue.Queue = queue.Queue()

    def pump():
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            break
        if line.startswith(prefix):
            return line[len(prefix) :].strip()
    proc.kill()
    proc.wait(10)
    raise RuntimeError(f"{proc.args[1]} never said {prefix!r} (exit {proc.returncode})")


if __name__ == "__main__":
    main()
