"""When the KV that a transfer touches is settled on the engine's stream.

vLLM launches a step's forward pass and returns: on CUDA the kernels that
write the step's KV (and the zeroing of newly allocated blocks, and any
earlier step still running under async scheduling) are only *queued* on the
current stream when the connector's ``start_load_kv`` / ``wait_for_save``
run. A ``StepFence`` is recorded on the current stream when the connector
is called. The copy engines (GPU KV) get it with the post, at once, and
their stream waits for its event on the GPU (copy_engine.py). NIXL copies on
streams of its own, so nothing would order a NIXL copy posted at that moment
after those kernels: the worker posts a NIXL transfer only once ``done()``
(polled, never blocking the engine thread), and a preemption flush or
shutdown, which must wait anyway, calls ``wait()``.

On CPU the forward pass has run to completion before the connector is
called, so the fence is always done.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch


class StepFence(Protocol):
    def done(self) -> bool:
        """True once every kernel queued before the fence has finished."""

    def wait(self) -> None:
        """Blocks until ``done()``."""


class DoneFence:
    """CPU: the forward pass ran synchronously; nothing is in flight."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


DONE = DoneFence()


class CudaFence:
    """A CUDA event recorded on the device's current stream. The copy engines
    wait for ``event`` on the GPU; NIXL's posts wait for ``done()``.
    ``cuda``: torch.cuda's event API (a fake in tests)."""

    def __init__(self, device: torch.device, cuda=torch.cuda):
        self.event = cuda.Event()
        self.event.record(cuda.current_stream(device))

    def done(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> None:
        self.event.synchronize()


def fence_maker(device: torch.device) -> Callable[[], StepFence]:
    """What records this step's fence for KV on ``device``."""
    if device.type == "cuda":
        return lambda: CudaFence(device)
    return lambda: DONE
