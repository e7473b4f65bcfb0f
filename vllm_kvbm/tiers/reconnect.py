"""When a network tier's link may be re-made, and what was said about it.

One policy for every link to a server (the lm:// views and stores, the
Redis/Valkey client): after a failure calls miss at once while the link is
re-made on a jittered exponential backoff (redis-py's ``EqualJitterBackoff``):
the n-th attempt of an outage waits a delay drawn from the upper half of
``retry_interval_s * 2**(n-1)``, capped at ``MAX_BACKOFF_FACTOR *
retry_interval_s``, and an answer resets it. The jitter keeps a fleet of
engines that lost one server together from reconnecting in step. The outage is logged once when it starts and once when
the server answers again (an answer, not a connect: a frozen server still
accepts connections, the kernel completes them). Imports neither LMCache nor
NIXL: the scheduler's views use it too.

The schedule is kept here rather than in redis-py's ``Retry``:
``Retry.call_with_retry`` sleeps on the thread that calls it, and the lm://
links ask ``may_try`` on vLLM's threads, which must never wait; the Redis
link's reconnect thread waits on its close event instead, so closing it ends
the wait at once.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from redis.backoff import EqualJitterBackoff

logger = logging.getLogger(__name__)

# The longest wait between two attempts, in retry intervals (16 s for 2 s).
MAX_BACKOFF_FACTOR = 8
# Each delay is drawn from [1 - JITTER, 1] times its step of the doubling
# (EqualJitterBackoff's half).
JITTER = 0.5


class Reconnect:
    """The backoff and up/down state of one link.

    ``what`` and ``target`` name it in the log ("remote tier", the URL);
    ``role`` says which of its links ("for reads", "for lookups", "").
    ``why`` passed to ``failed`` must be safe to log (no password).
    ``clock`` is for tests (a fake monotonic clock); the jitter draws from the
    ``random`` module, which a test seeds.
    """

    def __init__(
        self,
        retry_interval_s: float,
        what: str,
        target: str,
        role: str = "",
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.retry_s = float(retry_interval_s)
        self.max_s = self.retry_s * MAX_BACKOFF_FACTOR
        self._what, self._target = what, target
        self._role = f" {role}" if role else ""
        # compute(n) is drawn from the upper half of min(cap, base * 2**n):
        # base = retry_s / 2 makes attempt 1's step retry_s.
        self._backoff = EqualJitterBackoff(cap=self.max_s, base=self.retry_s / 2)
        self._clock = clock
        self._lock = threading.Lock()
        self._next_try = 0.0
        self._failures = 0  # failed attempts of this outage
        self._attempted = False  # an attempt started since the last failure
        self.state = "new"  # "new" | "up" | "down"
        self.outages_ended = 0  # outages the server answered after (the metrics)

    def delay(self, attempt: int) -> float:
        """Seconds to wait before attempt ``attempt`` (1, 2, ...) of an outage."""
        return self._backoff.compute(attempt)

    def may_try(self) -> bool:
        """True if a reconnect may start now; it then counts as an attempt (the
        next one waits until this one has failed, or its delay has passed)."""
        with self._lock:
            now = self._clock()
            if now < self._next_try:
                return False
            self._next_try = now + self.delay(self._failures + 1)
            self._attempted = True
            return True

    def wait_s(self) -> float:
        """Seconds until ``may_try`` can say yes (0: now)."""
        with self._lock:
            return max(0.0, self._next_try - self._clock())

    def failed(self, why) -> None:
        """The link failed (connect, call, timeout): the next attempt waits the
        backoff's next delay; logged when it starts an outage."""
        with self._lock:
            was, self.state = self.state, "down"
            if was != "down":
                self._failures = 1
            elif self._attempted:  # several calls failing at once are one failure
                self._failures += 1
            self._attempted = False
            self._next_try = self._clock() + self.delay(self._failures)
        if was != "down":
            logger.warning(
                "KVBM: %s %s unavailable%s (%s); its calls miss at once, "
                "reconnecting after %.1f-%.1fs, backing off to at most %.0fs",
                self._what,
                self._target,
                self._role,
                why,
                self.retry_s * (1 - JITTER),
                self.retry_s,
                self.max_s,
            )

    def answered(self) -> None:
        """The server answered a call: up (the backoff starts over), logged when
        it ends an outage."""
        with self._lock:
            was, self.state = self.state, "up"
            self._failures = 0
            self._attempted = False
            if was == "down":
                self.outages_ended += 1
        if was == "down":
            logger.warning("KVBM: %s %s reachable again%s", self._what, self._target, self._role)
