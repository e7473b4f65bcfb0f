"""torch.cuda's stream and event API over a simulated GPU, for code that orders copies on CUDA.

No GPU here: the copy engine (vllm_kvbm/worker/copy_engine.py) and the step
fence (worker/fence.py) take this module in place of ``torch.cuda``. It does
not order anything by itself: every stream is a queue of what the code asked
for (a kernel, a copy batch, an event recorded, a wait for an event), and
``run`` executes queued work in an order chosen against the code, copy
streams first wherever nothing the code asked for holds them back. A copy
that the code forgot to order after a kernel therefore runs before it and
copies the bytes from before: the mistake shows as wrong bytes, not only as a
missing line in a log. ``log`` lists what was asked, in order, for tests that
check the calls themselves.

Memory is CPU memory: a copy batch copies by address (``ctypes.memmove``),
as the driver's batch copy does, when it runs. CUDA's semantics kept: a wait
is for the event's latest record *at the time of the wait*; an event never
recorded is complete; ``wait_stream`` is a wait for an event recorded on the
other stream now; a batch with ``is_src_access_order_any`` may read its
sources at any time, so it reads them when it is queued (the earliest).
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager

import numpy as np
import torch

BYTES_PER_S = 20e9  # the simulated clock's copy speed


class _Op:
    __slots__ = ("kind", "label", "fn", "wait", "event", "seconds", "done", "at")

    def __init__(self, kind: str, label: str, fn=None, wait=None, event=None, seconds: float = 0.0):
        self.kind, self.label, self.fn, self.wait, self.event = kind, label, fn, wait, event
        self.seconds, self.done, self.at = seconds, False, None


class FakeEvent:
    def __init__(self, gpu: "FakeCuda", enable_timing: bool = False):
        self.gpu, self.enable_timing = gpu, enable_timing
        self.last: _Op | None = None  # its latest record

    def record(self, stream: "FakeStream | None" = None) -> None:
        stream = stream or self.gpu.current_stream()
        self.last = stream._push(_Op("record", f"record {self.name}", event=self))
        self.gpu.log.append(f"{stream.name}: record {self.name}")

    @property
    def name(self) -> str:
        return self.gpu.names.setdefault(id(self), f"event{len(self.gpu.names)}")

    def query(self) -> bool:
        return self.last is None or self.last.done

    def synchronize(self) -> None:
        """The host waits: the GPU runs until this event's record ran."""
        self.gpu.run(until=self.query)
        if not self.query():
            raise RuntimeError(f"{self.name} can never complete: its stream waits forever")

    def wait(self, stream: "FakeStream | None" = None) -> None:
        (stream or self.gpu.current_stream()).wait_event(self)

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.enable_timing and end.enable_timing, "events without timing"
        assert self.query() and end.query() and self.last and end.last
        return (end.last.at - self.last.at) * 1e3


class FakeStream:
    def __init__(self, gpu: "FakeCuda", name: str):
        self.gpu, self.name = gpu, name
        self.queue: list[_Op] = []

    def _push(self, op: _Op) -> _Op:
        self.queue.append(op)
        return op

    def wait_event(self, event: FakeEvent) -> None:
        self._push(_Op("wait", f"wait {event.name}", wait=event.last))
        self.gpu.log.append(f"{self.name}: wait_event {event.name}")

    def wait_stream(self, stream: "FakeStream") -> None:
        self.gpu.log.append(f"{self.name}: wait_stream {stream.name}")
        self.wait_event(stream.record_event())

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or FakeEvent(self.gpu)
        event.record(self)
        return event

    def query(self) -> bool:
        return not self.queue

    def synchronize(self) -> None:
        self.gpu.run(until=self.query)


class FakeCuda:
    """The part of ``torch.cuda`` the copy engine and the fence use, and the
    test's handle on the simulated GPU. ``compute`` is vLLM's current stream."""

    def __init__(self):
        self.log: list[str] = []
        self.names: dict[int, str] = {}
        self.clock = 0.0
        self.compute = FakeStream(self, "compute")
        self.streams = [self.compute]
        self._current = self.compute

    # ---- torch.cuda's API ---------------------------------------------------------

    def Stream(self, device=None, priority: int = 0) -> FakeStream:  # noqa: N802
        s = FakeStream(self, f"stream{len(self.streams)}")
        self.streams.append(s)
        return s

    def Event(
        self,
        enable_timing: bool = False,
        blocking: bool = False,  # noqa: N802
        interprocess: bool = False,
    ) -> FakeEvent:
        return FakeEvent(self, enable_timing)

    def current_stream(self, device=None) -> FakeStream:
        return self._current

    @contextmanager
    def stream(self, s: FakeStream):
        before, self._current = self._current, s
        try:
            yield
        finally:
            self._current = before

    # ---- what runs on a stream --------------------------------------------------------

    def launch(self, fn, label: str, seconds: float = 0.001) -> None:
        """A kernel on the current stream (the forward pass, a zeroing)."""
        self._current._push(_Op("kernel", label, fn=fn, seconds=seconds))
        self.log.append(f"{self._current.name}: kernel {label}")

    def swap_blocks_batch(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        sizes: torch.Tensor,
        is_src_access_order_any: bool = False,
    ) -> None:
        """vLLM's batch copy by address, queued on the current stream."""
        src, dst, sizes = (np.array(t.numpy(), dtype=np.int64) for t in (src, dst, sizes))
        if is_src_access_order_any:  # the sources may be read at once: they are
            staged = [ctypes.string_at(int(s), int(n)) for s, n in zip(src, sizes)]

            def copy():
                for d, data in zip(dst, staged):
                    ctypes.memmove(int(d), data, len(data))
        else:

            def copy():
                for s, d, n in zip(src, dst, sizes):
                    ctypes.memmove(int(d), int(s), int(n))

        self.launch(copy, f"batch of {len(sizes)} copies", int(sizes.sum()) / BYTES_PER_S)

    def foreach_copy(
        self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], non_blocking: bool = False
    ) -> None:
        """PyTorch's _foreach_copy_, queued on the current stream."""
        nbytes = sum(t.numel() * t.element_size() for t in srcs)
        self.launch(
            lambda: torch._foreach_copy_(dsts, srcs), f"{len(srcs)} copy_", nbytes / BYTES_PER_S
        )

    # ---- the test's side ------------------------------------------------------------

    def _runnable(self, s: FakeStream) -> bool:
        head = s.queue[0]
        return head.kind != "wait" or head.wait is None or head.wait.done

    def step(self, hold: tuple[FakeStream, ...] = ()) -> bool:
        """Runs one queued op, copy streams first; False if none can run."""
        order = [s for s in self.streams if s is not self.compute] + [self.compute]
        for s in order:
            if s.queue and s not in hold and self._runnable(s):
                op = s.queue.pop(0)
                if op.fn is not None:
                    op.fn()
                self.clock += op.seconds
                op.done, op.at = True, self.clock
                return True
        return False

    def run(self, until=None, hold: tuple[FakeStream, ...] = ()) -> None:
        """Runs until ``until()`` or nothing can run (``hold``: streams kept back)."""
        while not (until and until()) and self.step(hold):
            pass

    def idle(self) -> bool:
        return not any(s.queue for s in self.streams)
