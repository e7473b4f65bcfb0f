"""Requests held for the lower tiers' answer go on at the pace they arrived.

A request whose lookup waits for the lookup thread's answer (lookups.py) is
held: vLLM asks again each step. One stuck call (a frozen server, a hung
mount) holds every request that arrives meanwhile, and its answer (a miss,
at the tier's timeout) releases them all at once. vLLM would then prefill
them all in one step, whose length, their prefills together, is a gap in
every running request's token stream; without the connector each would have
been prefilled in a step of its own as it arrived. So held requests go on
one arrival step's worth per step, oldest first (vLLM asks its waiting
queue in order); those held from the same step go on together, as vLLM
would have admitted them together.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_kvbm.scheduler.request_state import _Lookup


class HeldRequests:
    """The scheduler's step count and which held requests go on in this step."""

    def __init__(self) -> None:
        self.step = 0  # scheduler steps so far (build_connector_meta)
        # (step, held_from) of the requests let go in that step
        self._going: tuple[int, int] | None = None
        self.deferred = 0  # answers kept back a step to keep the pace

    def next_step(self) -> None:
        self.step += 1

    def hold(self, lookup: "_Lookup") -> None:
        """The request's lookup has no answer in this step (vLLM asks again)."""
        if lookup.held_from is None:
            lookup.held_from = self.step

    def may_go(self, lookup: "_Lookup") -> bool:
        """Whether a request whose lookup has its answer now may go on in this
        step: always, unless it was held and requests held from another step
        go on in this one. Once it went on it is no longer held (vLLM may
        still find no room for it: it then waits as any request does)."""
        held_from = lookup.held_from
        if held_from is None:
            return True
        going = self._going
        if going is not None and going[0] == self.step and going[1] != held_from:
            self.deferred += 1
            return False
        self._going = (self.step, held_from)
        lookup.held_from = None
        return True
