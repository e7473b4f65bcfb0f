"""The interface of a tier below host RAM, as the worker side uses it."""

from __future__ import annotations

import torch


class TierStore:
    """What the connector needs from a lower tier."""

    name: str = ""
    # Pages its put may write at once (TierIO's writer threads for it): one
    # unless the store is safe and faster with several in flight.
    write_inflight: int = 1

    def put(self, key: bytes, page: torch.Tensor) -> bool:
        """Copies page (1-D uint8 CPU, block_bytes) before returning; False if refused/failed."""
        raise NotImplementedError

    def get_into(self, key: bytes, out: torch.Tensor) -> str:
        """Fills out -> "ok" | "miss" | "corrupt" (entry removed) | "unauthenticated"
        (no valid page MAC for this deployment's secret; entry removed) | "error".

        Only "ok" makes ``out`` usable: on anything else its content is
        undefined (a store may check a page where it lands), and the caller
        never serves it."""
        raise NotImplementedError

    def get_many_into(self, items: list[tuple[bytes, torch.Tensor]]) -> list[str]:
        """get_into for each ``(key, out)``; the statuses in order. A store
        that can read several pages at once in flight overrides this."""
        statuses = []
        for key, out in items:
            try:
                statuses.append(self.get_into(key, out))
            except Exception:  # noqa: BLE001 - a store must not take the engine down
                statuses.append("error")
        return statuses

    def contains(self, key: bytes) -> bool:
        raise NotImplementedError

    def remove(self, key: bytes) -> None:
        raise NotImplementedError

    def take_removed(self) -> list[bytes]:
        """Keys of pages this store deleted on its own (eviction, damage) since
        last asked, so the scheduler may write them again when they are hot."""
        return []

    def close(self) -> None:
        raise NotImplementedError

