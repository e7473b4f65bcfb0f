"""How long the scheduler's calls into the lower tiers' views take.

The lookup thread (lookups.py) asks the disk and remote tiers one call at a
time: a round trip to a server, a stat of a few files. Such a call usually
takes a few milliseconds; one running far longer means the tier hangs (a
frozen server, a hung network mount) and will answer, if at all, at its
timeout. Then the questions waiting on the thread are overdue, and the
requests behind them need not wait for them much (planner ``_waited_enough``).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_kvbm.tiers.base import TierView

# Lookup timings kept for the metrics between two scheduler steps, at most.
_MAX_TIMINGS = 10_000
# Weight of each new call's time in the decayed mean.
_KEEP = 0.1
# The lookup thread shares the GIL with the engine's busy loop: each time a
# call takes the GIL back (after a send, a recv) it may wait a switch
# interval, so a call may end this much later than its I/O without anything
# being wrong.
FLOOR_S = 4 * sys.getswitchinterval()


class TierCalls:
    """The usual time of one call (decayed mean plus four mean deviations,
    and a floor), and whether the call running now has exceeded it.

    A call that failed (the view is ``down`` after it: a frozen server's
    timeout) is not counted, and one longer than usual counts as the usual
    maximum: a freeze must not make the next one look usual, while a tier
    that got slower for good still raises the estimate, a step per call."""

    def __init__(self) -> None:
        self.mean = self.deviation = 0.0
        self.samples = 0
        self._since: float | None = None  # when the call running now began
        # (tier, seconds) of lookup calls for the metrics, taken by the
        # scheduler thread (take_samples); bounded should it stop taking
        self._lock = threading.Lock()
        self._timings: list[tuple[str, float]] = []

    @contextlib.contextmanager
    def timed(self, view: "TierView", sample: bool = False) -> Iterator[None]:
        """Times one call into ``view``; ``sample``: also for the lookup
        latency metric (a call made while the link was down, answered at
        once without the server, is not one)."""
        was_down = view.down
        began = self._since = time.monotonic()
        try:
            yield
        finally:
            self._since = None
            seconds = time.monotonic() - began
            if not view.down:
                self.add(seconds)
            if sample and not (was_down and view.down):
                with self._lock:
                    if len(self._timings) < _MAX_TIMINGS:
                        self._timings.append((view.name, seconds))

    def take_samples(self) -> list[tuple[str, float]]:
        with self._lock:
            taken, self._timings = self._timings, []
        return taken

    def add(self, seconds: float) -> None:
        if not self.samples:
            self.mean = seconds
        else:
            seconds = min(seconds, self.usual_max())
            self.deviation += _KEEP * (abs(seconds - self.mean) - self.deviation)
            self.mean += _KEEP * (seconds - self.mean)
        self.samples += 1

    def usual_max(self) -> float | None:
        """The longest a call usually takes; None before any."""
        if not self.samples:
            return None
        return self.mean + 4 * self.deviation + FLOOR_S

    def stuck(self) -> bool:
        """Whether a call is running longer than calls usually take (False
        while none has been timed)."""
        since, usual = self._since, self.usual_max()
        return since is not None and usual is not None and time.monotonic() - since > usual
