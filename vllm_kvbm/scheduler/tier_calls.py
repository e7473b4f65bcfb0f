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
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_kvbm.tiers.base import TierView

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

    @contextlib.contextmanager
    def timed(self, view: "TierView") -> Iterator[None]:
        """Times one call into ``view``."""
        began = self._since = time.monotonic()
        try:
            yield
        finally:
            self._since = None
            if not view.down:
                self.add(time.monotonic() - began)

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
