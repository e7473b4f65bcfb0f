"""Scheduler-side policy for the tiers below the host tier (pool, disk, remote).

Where a block is looked for (host first, then the pool, disk, remote), which
host blocks are written down to which tier (write-through, with an
admission filter for the disk), and how the worker's reports turn into
counters. The stores themselves run in the workers (``vllm_kvbm.tiers``); the
scheduler sees each tier through a small read-only view
(``tiers/base.py`` TierView, one per medium in ``tiers/<medium>/view.py``).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, defaultdict

from vllm_kvbm.keys import PageKey
from vllm_kvbm.scheduler.tier_calls import TierCalls
from vllm_kvbm.tiers.base import TierView

# Bound on the per-key bookkeeping below (use counts, recent writes): entries
# are keyed by the block key's hash (64 bits; computed once per bytes object
# and cached in it, so asking again is free; a collision only changes an
# admission decision, never what is loaded), about 10 MiB per table at most.
_MEMORY = 1 << 16


def _target(peer: "str | PeerTarget | None") -> "PeerTarget":
    return peer if isinstance(peer, PeerTarget) else PeerTarget(peer)


class _BoundedCounter(OrderedDict):
    """Counts per key hash for the most recently seen ``_MEMORY`` keys."""

    def bump(self, short: int) -> int:
        value = self.get(short, 0) + 1
        self[short] = value
        self.move_to_end(short)
        if len(self) > _MEMORY:
            self.popitem(last=False)
        return value


class PeerTarget:
    """The peer one question asks: the endpoint its request's hint names, or,
    without a hint, the one the peer directory names for its first pages
    asked (``endpoint`` is set then, and kept for the rest of the question:
    a load reads its peer pages from one peer)."""

    __slots__ = ("endpoint", "hinted")

    def __init__(self, endpoint: str | None = None):
        self.endpoint = endpoint
        self.hinted = endpoint is not None


class LowerTiers:
    def __init__(
        self,
        views: list[TierView],
        disk_admission: str = "always",
        disk_min_uses: int = 2,
        peer_view=None,
    ):
        self.views = views
        # peers' pools (tiers/peer/view.py), asked for requests whose hint
        # names one, after this machine's tiers; never written
        self.peer_view = peer_view
        self.disk_admission = disk_admission
        self.disk_min_uses = disk_min_uses
        self._uses = _BoundedCounter()
        # per tier: keys written recently. A page the disk deleted since (its
        # LRU, damage) is reported by the worker and forgotten here, so it is
        # written again when hot; a server's evictions are not reported, so
        # there the entry has to age out of the bounded table.
        self._written = {view.name: _BoundedCounter() for view in views}
        self.calls = TierCalls()  # how long each call into a view takes
        self._outages_seen: dict[str, int] = {}  # per tier: link outages counted
        self._lookups_seen = {"found": 0, "missed": 0}  # the peer directory's, counted
        # (tier, outcome) -> pages reported by each TP rank, and counted so far
        self._rank_totals: defaultdict[tuple[str, str], Counter] = defaultdict(Counter)
        self._counted: Counter = Counter()

    def __bool__(self) -> bool:
        return bool(self.views) or self.peer_view is not None

    def find_run_doubling(
        self, keys: list[PageKey], peer: "str | PeerTarget | None" = None
    ) -> list[str]:
        """``find_run`` asked in runs of 1, 2, 4, ... keys: a miss at the
        first block costs one small question, a long hit a few."""
        run: list[str] = []
        size = 1
        peer = _target(peer)  # one peer for the whole question
        while len(run) < len(keys):
            part = keys[len(run) : len(run) + size]
            found = self.find_run(part, peer)
            run += found
            if len(found) < len(part):
                break
            size *= 2
        return run

    def find_run(self, keys: list[PageKey], peer: "str | PeerTarget | None" = None) -> list[str]:
        """The tier of each key of the longest leading run of ``keys`` held
        below the host tier (the first tier, in lookup order, that has it)."""
        run: list[str] = []
        for tier in self.find_each(keys, peer):
            if tier is None:
                break
            run.append(tier)
        return run

    def find_each(
        self, keys: list[PageKey], peer: "str | PeerTarget | None" = None
    ) -> list[str | None]:
        """The first tier (in lookup order) holding each of ``keys``, None
        where none does. Each tier is asked once for all the keys the tiers
        before it lack (``contains_many``: one round trip to a server); the
        pool of ``peer`` (a control endpoint, or a PeerTarget: without an
        endpoint, the peer directory names one for the keys left) after this
        machine's tiers and before a remote server."""
        target = _target(peer)
        found: list[str | None] = [None] * len(keys)
        for view in self._in_order(target):
            todo = [i for i, tier in enumerate(found) if tier is None]
            if not todo:
                break
            batch = [keys[i] for i in todo]
            with self.calls.timed(view, sample=True):
                if view is not self.peer_view:
                    hits = view.contains_many(batch)
                else:
                    if target.endpoint is None:
                        target.endpoint = view.locate(batch)
                    hits = (
                        [False] * len(batch)
                        if target.endpoint is None
                        else view.contains_many_at(target.endpoint, batch)
                    )
            for i, hit in zip(todo, hits):
                if hit:
                    found[i] = view.name
        return found

    def _in_order(self, peer: PeerTarget) -> list:
        """The views to ask, in lookup order: a peer's host memory, read
        over the network, before a remote server's."""
        if self.peer_view is None or (
            peer.endpoint is None and getattr(self.peer_view, "directory", None) is None
        ):
            return self.views
        local = [v for v in self.views if v.name != "remote"]
        return local + [self.peer_view] + [v for v in self.views if v.name == "remote"]

    def set_own_endpoint(self, endpoint: str | None) -> None:
        """This engine's pool is served at ``endpoint``: never asked as a peer."""
        if hasattr(self.peer_view, "set_own"):
            self.peer_view.set_own(endpoint)

    def writes_fresh_pages(self) -> bool:
        """Whether a page stored for the first time is written to some tier
        (not so when only a frequency-filtered disk is configured)."""
        return any(view.name != "disk" or self.disk_admission != "frequency" for view in self.views)

    def disk_unknown(self, keys: list[PageKey]) -> list[PageKey]:
        """Of reused ``keys``, those to ask the disk about (``on_disk``) before
        ``admit``: the disk tier takes them unless it has them, and its
        bounded table of writes does not say."""
        if not any(view.name == "disk" for view in self.views):
            return []
        written = self._written["disk"]
        return [key for key in keys if hash(key) not in written]

    def on_disk(self, keys: list[PageKey]) -> set[PageKey]:
        """Which of ``keys`` the disk holds: a stat each, so never on vLLM's
        threads (a hung network filesystem blocks it)."""
        found: set[PageKey] = set()
        for view in self.views:
            if view.name == "disk":
                for key in keys:
                    with self.calls.timed(view):
                        if view.contains(key):
                            found.add(key)
        return found

    def admit(
        self,
        keys: list[PageKey],
        reused: bool,
        on_disk: set[PageKey] | frozenset = frozenset(),
        only: frozenset[str] | None = None,
    ) -> list[tuple[list[str], list[PageKey]]]:
        """The tiers ready host blocks ``keys`` should now be written to, as
        runs of consecutive keys going to the same tiers (keys no tier admits
        left out, order kept). ``on_disk``: reused keys the disk is known to
        hold (``on_disk``, asked off the scheduler thread); never asked here.
        ``only``: the tiers the request allows (None: all)."""
        runs: list[tuple[list[str], list[PageKey]]] = []
        views = [v for v in self.views if only is None or v.name in only]
        if not views:
            return runs
        shorts = [hash(key) for key in keys]
        # Use counts matter only to the frequency filter: not kept otherwise.
        uses = (
            [self._uses.bump(short) for short in shorts]
            if self.disk_admission == "frequency"
            else None
        )
        # Tier by tier (their tables are independent), then key by key.
        takes = [self._admit_to(view, keys, shorts, reused, uses, on_disk) for view in views]
        names = [view.name for view in views]
        last = None
        for key, flags in zip(keys, zip(*takes)):
            if flags != last:
                if not any(flags):
                    continue
                last = flags
                runs.append(([name for name, take in zip(names, flags) if take], []))
            runs[-1][1].append(key)
        return runs

    def _admit_to(
        self,
        view: TierView,
        keys: list[PageKey],
        shorts: list[int],
        reused: bool,
        uses: list[int] | None,
        on_disk,
    ) -> list[bool]:
        """Whether ``view``'s tier takes each of ``keys`` (noted as written)."""
        written = self._written[view.name]
        disk = view.name == "disk"
        ask, filtered = reused and disk, disk and uses is not None
        takes = []
        for i, short in enumerate(shorts):
            if short in written:
                takes.append(False)  # until the worker reports the page gone (forget)
                continue
            if ask and keys[i] in on_disk:
                # Reused and on disk, though the bounded table forgot it (or
                # another engine or an earlier run wrote it): a stat is
                # cheaper than a write. Fresh blocks are not asked about.
                take = False
            elif filtered and uses[i] < self.disk_min_uses:
                takes.append(False)  # seen once so far: not worth a disk write yet
                continue
            else:
                take = True
            written[short] = 1
            if len(written) > _MEMORY:
                written.popitem(last=False)
            takes.append(take)
        return takes

    def forget(self, tier: str, key: PageKey) -> None:
        """A page was found gone, corrupt or unauthenticated, or its write was
        dropped (the tier's write queue was full): allow writing it again."""
        if tier in self._written:
            self._written[tier].pop(hash(key), None)

    @staticmethod
    def onboard_counter(tier: str) -> str:
        return {
            "pool": "onboard_blocks_pool",
            "disk": "onboard_blocks_d2d",
            "peer": "onboard_blocks_peer",
            "remote": "onboard_blocks_remote",
        }[tier]

    def record(self, events: Counter, stats, num_workers: int = 1) -> None:
        """Turns the workers' (tier, outcome, rank) page counts into counters.

        Every worker reports its own shard of each page (with tensor
        parallelism, one report per rank), so per (tier, outcome) each
        rank's running total is kept: a page is stored once every rank
        stored its shard (the least total), and failed once any rank failed
        (the greatest). All count pages, the unit a tier stores (the
        engine-side counters count blocks: ``kvbm_page_size_blocks``)."""
        names = {
            "stored": {
                "pool": "offload_blocks_pool",
                "disk": "offload_blocks_h2d",
                "remote": "offload_blocks_remote",
            },
            "refused": "tier_write_errors",
            "dropped": "tier_write_drops",
            "miss": "tier_read_misses",
            "corrupt": "checksum_failures",
            "error": "tier_read_errors",
            "unauthenticated": "page_auth_failures",
        }
        touched = set()
        for (tier, outcome, rank), count in events.items():
            self._rank_totals[(tier, outcome)][rank] += count
            touched.add((tier, outcome))
        for tier, outcome in touched:
            name = names.get(outcome)
            if isinstance(name, dict):
                name = name.get(tier)
            if name is None:
                continue
            totals = self._rank_totals[(tier, outcome)]
            ranks = [totals[r] for r in range(num_workers)]
            pages = min(ranks) if outcome == "stored" else max(ranks)
            new, self._counted[(tier, outcome)] = pages - self._counted[(tier, outcome)], pages
            if new:
                if outcome == "stored":  # the family of its name is the tier's
                    stats.add(name, new)
                else:
                    stats.add(name, new, tier=tier)

    def report_links(self, stats) -> None:
        """The lookup thread's call times, the peer directory's lookups, and
        each server tier's link state (up, and outages ended), into
        ``stats``; on the scheduler thread."""
        for tier, seconds in self.calls.take_samples():
            stats.observe("lookup_latency_seconds", [seconds], tier)
        directory = getattr(self.peer_view, "directory", None)
        if directory is not None:  # counted on the lookup thread; each only grows
            for result in ("found", "missed"):
                total = getattr(directory, result)
                stats.add("peer_directory_lookups", total - self._lookups_seen[result], result)
                self._lookups_seen[result] = total
        for view in self.views:
            link = view.link
            if link is None:
                continue
            stats.set_gauge("tier_up", 0.0 if link.state == "down" else 1.0, view.name)
            ended = link.outages_ended - self._outages_seen.get(view.name, 0)
            if ended:
                stats.add("tier_reconnects", ended, tier=view.name)
                self._outages_seen[view.name] = link.outages_ended
