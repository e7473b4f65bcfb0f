"""The worker's records of its transfers: one posted to the page mover (NIXL
or the copy engine: ``InFlight``) and one waiting for its step's fence
(``Pending``); ``KVBMWorker`` (worker.py) keeps lists of them."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_kvbm.messages import TransferJob
from vllm_kvbm.worker.fence import StepFence

# A transfer still running this long after it was posted is overdue (see
# KVBMWorker._overdue): a stuck copy degrades to a cache miss, never to a
# wrong page or an engine that waits forever for a preempted request's store.
TRANSFER_TIMEOUT_S = 30.0


@dataclass
class InFlight:
    """A transfer posted to the page mover, polled until it ends."""

    job: TransferJob
    is_store: bool
    handle: object
    started: float
    # past the timeout and already dealt with; still polled until the copy ends
    overdue: bool = False


@dataclass
class Pending:
    """A transfer not posted yet: its step's fence is not done."""

    job: TransferJob
    is_store: bool
    fence: StepFence
    queued: float
