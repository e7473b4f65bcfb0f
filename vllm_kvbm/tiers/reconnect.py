"""When a network tier's link may be re-made, and what was said about it.

One policy for every link to a server (the lm:// views and stores, the
Redis/Valkey client): after a failure the link is re-made at most every
``retry_interval_s`` while calls miss at once; the outage is logged once
when it starts and once when the server answers again (an answer, not a
connect: a frozen server still accepts connections, the kernel completes
them). Imports neither LMCache nor NIXL: the scheduler's views use it too.
"""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger(__name__)


class Reconnect:
    """The retry-interval and up/down state of one link.

    ``what`` and ``target`` name it in the log ("remote tier", the URL);
    ``role`` says which of its links ("for reads", "for lookups", "").
    ``why`` passed to ``failed`` must be safe to log (no password).
    """

    def __init__(self, retry_interval_s: float, what: str, target: str, role: str = ""):
        self.retry_s = float(retry_interval_s)
        self._what, self._target = what, target
        self._role = f" {role}" if role else ""
        self._lock = threading.Lock()
        self._next_try = 0.0
        self.state = "new"  # "new" | "up" | "down"

    def may_try(self) -> bool:
        """True if a reconnect may start now; it then counts as the attempt of
        this interval (the next one waits ``retry_interval_s``)."""
        with self._lock:
            now = time.monotonic()
            if now < self._next_try:
                return False
            self._next_try = now + self.retry_s
            return True

    def failed(self, why) -> None:
        """The link failed (connect, call, timeout): no attempt before the
        interval has passed; logged when it starts an outage."""
        with self._lock:
            self._next_try = time.monotonic() + self.retry_s
            was, self.state = self.state, "down"
        if was != "down":
            logger.warning("KVBM: %s %s unavailable%s (%s); its calls miss at once, "
                           "reconnecting at most every %.1fs", self._what, self._target,
                           self._role, why, self.retry_s)

    def answered(self) -> None:
        """The server answered a call: up, logged when it ends an outage."""
        with self._lock:
            was, self.state = self.state, "up"
        if was == "down":
            logger.warning("KVBM: %s %s reachable again%s", self._what, self._target,
                           self._role)
