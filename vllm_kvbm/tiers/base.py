"""The interfaces of a tier below host RAM: its store (worker side) and its view (scheduler side).

One medium (disk, an LMCache server, Redis/Valkey) is one folder under
tiers/ with a ``store.py`` (a TierStore: what TierIO calls in the workers)
and a ``view.py`` (a TierView: what LowerTiers and BackgroundLookups call in
the scheduler), both found through ``tiers/registry.py``. This module
imports neither torch nor LMCache nor NIXL: the scheduler process loads it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from vllm_kvbm.keys import PageKey
    from vllm_kvbm.tiers.reconnect import Reconnect


class TierStore(ABC):
    """A tier's pages, read and written by a worker (TierIO's threads). No
    method raises into the engine; each is bounded by the medium's timeout."""

    name: str = ""
    # Pages its put may write at once (TierIO's writer threads for it): one
    # unless the store is safe and faster with several in flight.
    write_inflight: int = 1

    @abstractmethod
    def put(self, key: bytes, page: "torch.Tensor") -> bool:
        """Copies page (1-D uint8 CPU, page bytes) before returning; False if refused/failed."""

    @abstractmethod
    def get_into(self, key: bytes, out: "torch.Tensor") -> str:
        """Fills out -> "ok" | "miss" | "corrupt" (entry removed) | "unauthenticated"
        (no valid page MAC for this deployment's secret; entry removed) | "error".

        Only "ok" makes ``out`` usable: on anything else its content is
        undefined (a store may check a page where it lands), and the caller
        never serves it. "late" (a store that reads by DMA: its read missed
        its deadline and may still write ``out``): nor may the caller reuse
        ``out`` before take_ended_writes names its address."""

    def get_many_into(
        self, items: list[tuple[bytes, "torch.Tensor"]], stop: "Callable[[], bool] | None" = None
    ) -> list[str]:
        """get_into for each ``(key, out)``; the statuses in order. Once
        ``stop()`` is true the pages not read yet are "skipped" (a fetch
        given up on stops at its next page). A store that can read several
        pages at once in flight overrides this."""
        statuses = []
        for key, out in items:
            if stop is not None and stop():
                statuses.append("skipped")
                continue
            try:
                statuses.append(self.get_into(key, out))
            except Exception:  # noqa: BLE001 - a store must not take the engine down
                statuses.append("error")
        return statuses

    def reads_into(self, memory: "torch.Tensor") -> None:
        """The memory every ``out`` of get_many_into lies in (the host tier's
        slots), once before the first read, on the tier's read thread: a
        store that reads by DMA registers it and reads in place."""

    def take_ended_writes(self) -> list[int]:
        """Addresses (``data_ptr``) of "late" ``out``s whose read has ended
        since last asked; called on the tier's read thread."""
        return []

    @abstractmethod
    def contains(self, key: bytes) -> bool:
        """Whether this rank's page for ``key`` is stored."""

    @abstractmethod
    def remove(self, key: bytes) -> None:
        """Deletes the page (a miss from then on); never raises."""

    def usage(self) -> tuple[int, int] | None:
        """(bytes used, capacity in bytes) of this rank's pages, where the
        store keeps that count (the disk); None otherwise (a server's is its own)."""
        return None

    def counts(self) -> dict[str, int]:
        """What the store counts of itself for the metrics, by name (running
        totals, or a level such as ``quarantined``); read on vLLM's worker
        thread every step, so memory reads only. Empty: nothing."""
        return {}

    def take_removed(self) -> list[bytes]:
        """Keys of pages this store deleted on its own (eviction, damage) since
        last asked, so the scheduler may write them again when they are hot."""
        return []

    @abstractmethod
    def close(self) -> None:
        """Releases files, connections and threads; later calls fail or miss."""


class TierView(ABC):
    """A tier as the scheduler sees it: read-only, by page name, without
    LMCache or NIXL. ``name`` is the tier's name in TransferJobs and metrics
    ("disk", "remote"), the same as its store's."""

    name: str = ""

    @abstractmethod
    def contains(self, key: "PageKey") -> bool:
        """Whether every rank's page for ``key`` is there; a failure is a miss."""

    def contains_many(self, keys: list["PageKey"]) -> list[bool]:
        """contains for each of ``keys``, in order. A view that answers many
        keys in one round trip (a server) overrides this."""
        return [self.contains(key) for key in keys]

    @property
    def down(self) -> bool:
        """Whether its last call failed (the server unreachable, a timeout):
        then that call's time says nothing of a healthy one (TierCalls)."""
        return False

    @property
    def link(self) -> "Reconnect | None":
        """The up/down state of its link to a server (None: no server), for
        the metrics."""
        return None

    def close(self) -> None:
        """Releases its connection, if any."""
