"""Scheduler-side policy for the tiers below the host tier (disk, remote).

Where a block is looked for (host first, then disk, then remote), which
host blocks are written down to which tier (write-through, with an
admission filter for the disk), and how the worker's reports turn into
counters. The stores themselves run in the workers (``vllm_kvbm.tiers``); the
scheduler sees each tier through a small read-only view with ``contains``
(``lookups.py``).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Protocol

from vllm_kvbm.keys import BlockKey

# Bound on the per-key bookkeeping below (use counts, recent writes).
_MEMORY = 1 << 20


class TierView(Protocol):
    name: str

    def contains(self, key: BlockKey) -> bool: ...


class _BoundedCounter(OrderedDict):
    def bump(self, key) -> int:
        value = self.get(key, 0) + 1
        self[key] = value
        self.move_to_end(key)
        if len(self) > _MEMORY:
            self.popitem(last=False)
        return value


class LowerTiers:
    def __init__(self, views: list[TierView], disk_admission: str = "always",
                 disk_min_uses: int = 2):
        self.views = views
        self.disk_admission = disk_admission
        self.disk_min_uses = disk_min_uses
        self._uses = _BoundedCounter()
        self._written = _BoundedCounter()  # (tier, key) recently written

    def __bool__(self) -> bool:
        return bool(self.views)

    def find(self, key: BlockKey) -> str | None:
        for view in self.views:
            if view.contains(key):
                return view.name
        return None

    def admit(self, key: BlockKey, reused: bool) -> list[str]:
        """Tiers a ready host block should now be written to."""
        if not self.views:
            return []
        uses = self._uses.bump(key)
        tiers = []
        for view in self.views:
            if (view.name, key) in self._written:
                continue
            if (view.name == "disk" and self.disk_admission == "frequency"
                    and uses < self.disk_min_uses):
                continue  # seen once so far: not worth a disk write yet
            self._written.bump((view.name, key))
            tiers.append(view.name)
        return tiers

    def forget(self, tier: str, key: BlockKey) -> None:
        """A page was found gone, corrupt or unauthenticated: allow writing it again."""
        self._written.pop((tier, key), None)

    @staticmethod
    def onboard_counter(tier: str) -> str:
        return {"disk": "onboard_blocks_d2d", "remote": "onboard_blocks_remote"}[tier]

    @staticmethod
    def record(events: Counter, stats) -> None:
        """Turns the worker's (tier, outcome) page counts into counters."""
        names = {"stored": {"disk": "offload_blocks_h2d", "remote": "offload_blocks_remote"},
                 "refused": "tier_write_errors", "miss": "tier_read_misses",
                 "corrupt": "checksum_failures", "error": "tier_read_errors",
                 "unauthenticated": "page_auth_failures"}
        for (tier, outcome), count in events.items():
            name = names.get(outcome)
            if isinstance(name, dict):
                name = name.get(tier)
            if name is not None:
                stats.add(name, count)
