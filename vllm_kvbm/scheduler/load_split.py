"""Load or recompute: how much of a found prefix is worth loading.

A hit from a slow tier can take longer than computing the same tokens again
(SGLang #26305, Dynamo #6101). The scheduler learns, as it runs, how long a
load takes from each tier (a fixed latency and a time per page: TierCost)
and how long prefill takes, and per
request loads only the prefix part whose load is expected to cost less than
recomputing it; vLLM recomputes the rest (the load/recompute split of Cake,
ICML 2025). Until it has measured both, everything found is loaded.

Costs are wall time as requests see it (a load from admission to its last
rank's completion, a prefill from its first scheduled chunk to its first
token), so queueing behind other work counts on both sides.
"""

from __future__ import annotations

import time
from collections import Counter

# Decay of old prefill samples in the least-squares fit, per new sample.
_KEEP = 0.9
# A tier judged slower than recompute is tried again after this long, so a
# tier that got fast again is noticed: one request loads its first
# PROBE_BLOCKS blocks from it whatever they cost, and the load measures it.
# While the tier stays slow a probe costs its request about recomputing those
# pages once more (the load is cut when it runs late): kept small.
PROBE_AFTER_S = 30.0
PROBE_BLOCKS = 2


# Decay of old load samples in a tier's fit, per new sample: a tier that
# slows down (a congested server) is followed within a few loads.
_KEEP_LOAD = 0.5


class TierCost:
    """Time to load ``n`` pages from one tier, fitted as ``latency + n *
    per_page``: a fixed part (round trips, a seek) and a part per page (its
    bytes over the link's bandwidth: pages have one size per engine, so per
    page is per byte times ``page_bytes``). Decayed least squares, as
    PrefillModel.

    A tier reads one load at a time (worker/tier_io.py): a load planned
    behind ``k`` others holding ``q`` pages of the tier ends after about
    ``(k+1)*latency + (q+n)*per_page``, so each sample is fitted with the
    loads and pages ahead of it, and costs are asked with those in flight
    (concurrent loads share the tier instead of each looking slower)."""

    def __init__(self) -> None:
        # decayed sums for the fit of (loads, pages) -> seconds, through the origin
        self._s11 = self._s12 = self._s22 = self._s1t = self._s2t = 0.0
        self.latency = self.per_page = 0.0
        self.updated = 0.0

    def add(self, pages: int, seconds: float, now: float, ahead: tuple[int, int] = (0, 0)) -> None:
        """A load of ``pages`` took ``seconds``, planned behind ``ahead`` =
        (loads, pages) of this tier still in flight."""
        x1, x2 = 1.0 + ahead[0], float(pages + ahead[1])
        k = _KEEP_LOAD
        self._s11 = k * self._s11 + x1 * x1
        self._s12 = k * self._s12 + x1 * x2
        self._s22 = k * self._s22 + x2 * x2
        self._s1t = k * self._s1t + x1 * seconds
        self._s2t = k * self._s2t + x2 * seconds
        self.updated = now
        self.latency, self.per_page = self._fit()

    def _fit(self) -> tuple[float, float]:
        """Both parts >= 0; all per page when the samples cannot tell them
        apart (loads of one length, nothing ahead)."""
        det = self._s11 * self._s22 - self._s12 * self._s12
        if det > 1e-9 * self._s11 * self._s22:
            latency = (self._s1t * self._s22 - self._s2t * self._s12) / det
            per_page = (self._s2t * self._s11 - self._s1t * self._s12) / det
            if per_page >= 0 and latency >= 0:
                return latency, per_page
        return 0.0, (self._s2t / self._s22 if self._s22 > 0 else 0.0)

    def seconds(self, pages: int, ahead: tuple[int, int] = (0, 0)) -> float:
        if not pages:
            return 0.0
        return self.latency * (1 + ahead[0]) + self.per_page * (pages + ahead[1])


class PrefillModel:
    """Prefill time of ``n`` tokens after ``s`` cached ones, fitted as
    ``a*n + b*n*(2s+n)/2``: a per-token part and an attention part that grows
    with the position (so later blocks cost more to recompute)."""

    def __init__(self) -> None:
        # decayed sums for the 2x2 least-squares fit of (x1, x2) -> t
        self._s11 = self._s12 = self._s22 = self._s1t = self._s2t = self._stt = 0.0
        self.samples = 0
        self.a = self.b = 0.0

    def add(self, start: int, tokens: int, seconds: float) -> None:
        x1, x2 = float(tokens), tokens * (2.0 * start + tokens) / 2.0
        k = _KEEP
        self._s11 = k * self._s11 + x1 * x1
        self._s12 = k * self._s12 + x1 * x2
        self._s22 = k * self._s22 + x2 * x2
        self._s1t = k * self._s1t + x1 * seconds
        self._s2t = k * self._s2t + x2 * seconds
        self._stt = k * self._stt + seconds * seconds
        self.samples += 1
        self.a, self.b = self._fit()

    def _fit(self) -> tuple[float, float]:
        """The least-squares (a, b) with both >= 0 (one of them 0 when the
        samples cannot tell the two apart, e.g. all the same length)."""
        candidates = []
        det = self._s11 * self._s22 - self._s12 * self._s12
        if det > 1e-12 * self._s11 * self._s22:
            a = (self._s1t * self._s22 - self._s2t * self._s12) / det
            b = (self._s2t * self._s11 - self._s1t * self._s12) / det
            if a >= 0 and b >= 0:
                candidates.append((a, b))
        if self._s11 > 0:
            candidates.append((self._s1t / self._s11, 0.0))
        if self._s22 > 0:
            candidates.append((0.0, self._s2t / self._s22))
        if not candidates:
            return 0.0, 0.0

        def residual(ab):
            a, b = ab  # sum of (t - a*x1 - b*x2)^2, from the sums
            return (
                self._stt
                - 2 * a * self._s1t
                - 2 * b * self._s2t
                + a * a * self._s11
                + 2 * a * b * self._s12
                + b * b * self._s22
            )

        return min(candidates, key=residual)

    def seconds(self, start: int, tokens: int) -> float:
        """Time to compute ``tokens`` tokens after ``start`` cached ones."""
        return tokens * (self.a + self.b * (2.0 * start + tokens) / 2.0)

    def block_seconds(self, block: int, block_size: int) -> float:
        """Time to recompute block ``block`` (tokens block*B .. (block+1)*B)."""
        return block_size * (self.a + self.b * block_size * (block + 0.5))


class LoadSplit:
    """Learns load and prefill costs; ``cut`` says how many blocks to load."""

    def __init__(self, block_size: int, enabled: bool = True, clock=time.monotonic):
        self.block_size = block_size
        self.enabled = enabled
        self.clock = clock
        self.prefill = PrefillModel()
        self.load: dict[str, TierCost] = {}  # tier -> what loading n pages costs
        self._probed: dict[str, float] = {}

    # ---- learning ---------------------------------------------------------

    def prefill_done(self, start: int, tokens: int, seconds: float) -> None:
        """A request computed ``tokens`` prompt tokens after ``start`` cached
        ones in ``seconds`` (first chunk scheduled to first token)."""
        if tokens >= 2 * self.block_size and seconds > 0:  # shorter: mostly step overhead
            self.prefill.add(start, tokens, seconds)

    def load_done(
        self, blocks: Counter, seconds: float, ahead: dict[str, tuple[int, int]] | None = None
    ) -> None:
        """A load of ``blocks[tier]`` blocks per tier took ``seconds``,
        planned behind ``ahead[tier]`` = (loads, pages) of lower-tier loads
        in flight. The host tier's cost comes from host-only loads; a lower
        tier's from loads with host blocks and that one tier (the host part
        subtracted)."""
        now = self.clock()
        lower = [tier for tier, n in blocks.items() if tier != "host" and n]
        host = blocks.get("host", 0)
        if not lower and host:
            self._learn("host", host, seconds, now)
        elif len(lower) == 1:
            rest = seconds - self.load_seconds("host", host)
            self._learn(
                lower[0], blocks[lower[0]], max(rest, 0.0), now, (ahead or {}).get(lower[0], (0, 0))
            )

    def _learn(
        self, tier: str, pages: int, seconds: float, now: float, ahead: tuple[int, int] = (0, 0)
    ) -> None:
        self.load.setdefault(tier, TierCost()).add(pages, seconds, now, ahead)

    def load_seconds(self, tier: str, pages: int) -> float:
        est = self.load.get(tier)
        return est.seconds(pages) if est is not None else 0.0

    def seconds_per_block(self, tier: str) -> float:
        """The per-page part of the tier's cost (its fixed latency apart)."""
        est = self.load.get(tier)
        return est.per_page if est is not None else 0.0

    # ---- deciding ---------------------------------------------------------

    def wait_bound(self, start: int, count: int) -> float | None:
        """How long a request may wait for the lower tiers' answer about
        blocks ``start .. start+count``: what recomputing them costs, the most
        the answer could save. None when the split is off or the prefill cost
        is not known yet (then it waits for the answer, bounded by the tiers'
        own timeouts)."""
        if not self.enabled or self.prefill.samples < 2:
            return None
        return self.prefill.seconds(start * self.block_size, count * self.block_size)

    def cut(
        self, sources: list[str], start: int, ahead: dict[str, tuple[int, int]] | None = None
    ) -> int:
        """How many of the found blocks (``sources[i]`` holds block
        ``start + i``) to load: the prefix whose expected load time, less the
        recompute time it saves, is least; a tier's fixed part (its latency,
        and the loads ``ahead`` of it in flight: (loads, pages) per tier) is
        paid with its first block in the prefix. Everything when the split is
        off or the prefill cost is not known yet."""
        if not self.enabled or not sources or self.prefill.samples < 2:
            return len(sources)
        now = self.clock()
        costs, probes = {}, set()
        for tier in set(sources):
            est = self.load.get(tier)
            if (
                est is not None
                and now - est.updated > PROBE_AFTER_S
                and now - self._probed.get(tier, -PROBE_AFTER_S) > PROBE_AFTER_S
            ):
                probes.add(tier)
            # Unknown: load it (the load measures the tier).
            if est is None:
                costs[tier] = (0.0, 0.0)
            else:
                loads, pages = (ahead or {}).get(tier, (0, 0))
                costs[tier] = (est.latency * (1 + loads) + est.per_page * pages, est.per_page)
        free = dict.fromkeys(probes, PROBE_BLOCKS)  # a probe's blocks count as free
        best, best_k, total = 0.0, 0, 0.0
        for i, tier in enumerate(sources):
            fixed, cost = costs[tier]
            if fixed:  # paid once, with the tier's first page in the prefix
                costs[tier] = (0.0, cost)
                cost += fixed
            if free.get(tier):
                free[tier] -= 1
                cost = 0.0
            total += cost - self.prefill.block_seconds(start + i, self.block_size)
            if total <= best:
                best, best_k = total, i + 1
        for tier in probes.intersection(sources[:best_k]):
            self._probed[tier] = now  # one request at a time probes a stale tier
        return best_k
