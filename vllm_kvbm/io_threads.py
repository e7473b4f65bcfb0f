"""Thread pools for tier I/O whose shutdown has a deadline.

A read on a hung filesystem or a frozen server cannot be interrupted once
in its syscall. concurrent.futures' ThreadPoolExecutor can only wait for
such a thread (shutdown(wait=True), and again at interpreter exit, which
joins every pool thread): one stuck read would hold an engine's shutdown
and its process's exit for as long as the filesystem hangs. IOThreads runs
daemon threads and ``join`` waits for them until a deadline only; a thread
still in a call then is left to end with the process.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from concurrent.futures import Executor, Future

logger = logging.getLogger(__name__)


class IOThreads(Executor):
    """``workers`` daemon threads named ``<name>_<i>`` running submitted calls in order."""

    def __init__(self, workers: int, name: str, initializer=None):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._shut = False
        self._initializer = initializer
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}_{i}", daemon=True)
            for i in range(max(1, workers))
        ]
        for t in self._threads:
            t.start()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        with self._lock:
            if self._shut:
                raise RuntimeError("cannot submit after shutdown")
            self._queue.put((future, fn, args, kwargs))
        return future

    def _run(self) -> None:
        if self._initializer is not None:
            try:
                self._initializer()
            except Exception as e:  # noqa: BLE001 - the thread still works without it
                logger.warning("KVBM: I/O thread initializer failed: %s", e)
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                future.set_exception(e)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stops taking calls; ``cancel_futures``: queued calls never run.
        ``wait`` waits without a deadline: prefer ``join``."""
        with self._lock:
            if not self._shut:
                self._shut = True
                if cancel_futures:
                    while True:
                        try:
                            item = self._queue.get_nowait()
                        except queue.Empty:
                            break
                        if item is not None:
                            item[0].cancel()
                for _ in self._threads:
                    self._queue.put(None)
        if wait:
            for t in self._threads:
                t.join()

    def join(self, deadline: float) -> list[threading.Thread]:
        """Waits for the threads until ``deadline`` (time.monotonic) after
        shutdown; -> those still running (stuck in a call)."""
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return [t for t in self._threads if t.is_alive()]


def close_pools(pools: "list[IOThreads]", timeout_s: float, what: str) -> None:
    """Shuts ``pools`` down, queued calls dropped, and waits up to
    ``timeout_s`` for their running calls; threads still in one are named in
    a warning and left behind (daemon threads: they end with the process)."""
    for pool in pools:
        pool.shutdown(wait=False, cancel_futures=True)
    deadline = time.monotonic() + timeout_s
    stuck = [t.name for pool in pools for t in pool.join(deadline)]
    if stuck:
        logger.warning(
            "KVBM: %s: %d I/O thread(s) still in a call after %g s at shutdown "
            "(a hung filesystem or server?): %s; left running, they end with the "
            "process",
            what,
            len(stuck),
            timeout_s,
            ", ".join(stuck),
        )


def where_threads_are(prefixes: tuple[str, ...], depth: int = 4) -> str:
    """For a log line that says what a stalled tier waits in: per live
    thread whose name starts with one of ``prefixes`` and that is not an
    IOThreads thread waiting for work, its name and innermost ``depth``
    Python frames (file:line function); "none busy" if no such thread is.
    Names only, no locals: nothing of a page, a key or a secret."""
    frames = sys._current_frames()
    where = []
    for thread in threading.enumerate():
        frame, calls = frames.get(thread.ident), []
        if not thread.name.startswith(prefixes) or (
            frame is not None and frame.f_code is IOThreads._run.__code__
        ):
            continue
        while frame is not None and len(calls) < depth:
            code = frame.f_code
            calls.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno} {code.co_name}")
            frame = frame.f_back
        where.append(f"{thread.name} in " + " <- ".join(calls or ["?"]))
    return "; ".join(where) or "none busy (the read ended meanwhile)"
