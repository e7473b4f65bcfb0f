"""LoRA adapters' fingerprints for the scheduler, taken on a thread of their own.

A request's keys name its adapter by a fingerprint of its files
(fingerprints.adapter_fingerprint): a scandir and a stat per file, a hash of
the whole adapter when it was written in the last two seconds (an RL loop
saving it every few seconds: at every request), an HF id's snapshot look-up,
a file lock another process may hold. None of that may run on vLLM's
scheduler thread, where a slow or hung filesystem would stall every request.

So ``get`` reads only what this thread found at its last check of the path
and asks it to check again. A path it has not fingerprinted yet, or whose
check is overdue (``CHECK_OVERDUE_S``: a hung filesystem), has no fingerprint:
its request is a miss (not looked up, not stored), never a wait. A
fingerprint may be one check old, so files rewritten just before a request
can still name the old weights: the workers refuse every job whose keys name
other weights than the ones vLLM loaded for the adapter (worker/lora_loads.py),
so that costs a recompute, never another adapter's KV.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

logger = logging.getLogger(__name__)

# A check asked for this long ago and not done (a hung filesystem, a long
# hash queued before it): its adapter is a miss until it ends.
CHECK_OVERDUE_S = 5.0
# Paths remembered at most (the oldest checked go first).
MAX_PATHS = 1024


def _adapter_fingerprint(path: str) -> str:
    from vllm_kvbm.fingerprints import adapter_fingerprint

    return adapter_fingerprint(path)


class AdapterFingerprints:
    """``fingerprint(path)``: what a check computes (the files' fingerprint,
    "" when there are none)."""

    def __init__(self, fingerprint: Callable[[str], str] = _adapter_fingerprint):
        self._fingerprint = fingerprint
        self._cond = threading.Condition()
        self._known: dict[str, str] = {}  # path -> its last check's fingerprint
        self._asked: dict[str, float] = {}  # path -> when its pending check was asked
        self._queue: collections.deque[str] = collections.deque()
        self._thread: threading.Thread | None = None

    def get(self, path: str) -> str | None:
        """The fingerprint of ``path``'s files at its last check (None: not
        fingerprinted yet, or its check is overdue); asks for a new check.
        Touches no file: called on vLLM's scheduler thread."""
        now = time.monotonic()
        with self._cond:
            asked = self._asked.get(path)
            if asked is None:
                self._asked[path] = now
                self._queue.append(path)
                self._cond.notify()
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, daemon=True, name="kvbm-lora-fingerprints"
                    )
                    self._thread.start()
            elif now - asked > CHECK_OVERDUE_S:
                return None
            return self._known.get(path)

    def settled(self, timeout: float) -> bool:
        """Waits until no check is pending (tests, tools); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._asked, timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue)
                path = self._queue.popleft()
            try:
                fingerprint: str | None = self._fingerprint(path)
            except Exception:  # noqa: BLE001 - an adapter not fingerprinted is a miss
                logger.exception(
                    "KVBM: fingerprinting LoRA adapter %s failed; its requests are not cached", path
                )
                fingerprint = None
            with self._cond:
                self._known.pop(path, None)
                if fingerprint is not None:
                    self._known[path] = fingerprint
                    if len(self._known) > MAX_PATHS:
                        del self._known[next(iter(self._known))]
                del self._asked[path]
                self._cond.notify_all()
