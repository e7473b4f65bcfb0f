"""The host tier's memory: exactly the bytes of its slots, pinned for DMA on CUDA.

``torch.zeros(..., pin_memory=True)`` goes through PyTorch's caching host
allocator, which rounds every allocation up to a power of two (a 20 GiB host
tier would pin 32 GiB). As vLLM's own CPU offloading does, the pool is an
ordinary allocation of exactly ``num_slots * slot_bytes`` bytes (an anonymous
mapping: page aligned, zeroed by the kernel as it is touched) that is then
registered with ``cudaHostRegister``, in chunks that end on slot and page
boundaries (no page in two registrations, no page of a slot in two), and
unregistered on shutdown.
"""

from __future__ import annotations

import logging
import math
import mmap

import torch

logger = logging.getLogger(__name__)

# Bound on one cudaHostRegister call (vLLM uses the same bound against driver
# limits on very large host registrations).
MAX_REGISTER_BYTES = 64 * 1024**3


class HostPool:
    def __init__(self, num_slots: int, slot_bytes: int, pin: bool,
                 max_register_bytes: int = MAX_REGISTER_BYTES):
        total = num_slots * slot_bytes
        self._mapping = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.tensor = torch.frombuffer(self._mapping, dtype=torch.uint8,
                                       count=total).view(num_slots, slot_bytes)
        self._registered: list[int] = []
        if pin:
            self._pin(slot_bytes, max_register_bytes)

    @property
    def pinned(self) -> bool:
        return bool(self._registered)

    def _pin(self, slot_bytes: int, max_register_bytes: int) -> None:
        cudart = torch.cuda.cudart()
        base, total = self.tensor.data_ptr(), self.tensor.numel()
        unit = math.lcm(slot_bytes, mmap.PAGESIZE)
        chunk = max(max_register_bytes // unit, 1) * unit
        for offset in range(0, total, chunk):
            size = min(chunk, total - offset)
            err = cudart.cudaHostRegister(base + offset, size, 0)
            if _code(err) != 0:
                logger.warning(
                    "KVBM: cudaHostRegister of the host tier failed (%s) at %.2f of "
                    "%.2f GiB; it stays pageable: transfers stay correct but slower",
                    err, offset / 1024**3, total / 1024**3)
                self.release()
                return
            self._registered.append(base + offset)

    def release(self) -> None:
        """Unregisters the pinned ranges. Only once no transfer can touch them."""
        if not self._registered:
            return
        cudart = torch.cuda.cudart()
        for addr in reversed(self._registered):
            err = cudart.cudaHostUnregister(addr)
            if _code(err) != 0:
                logger.warning("KVBM: cudaHostUnregister failed (%s)", err)
        self._registered = []


def _code(err) -> int:
    return int(getattr(err, "value", err))
