"""Whether each request arrived alone or queued, and TTFT split by round and arrival.

A request is **queued** when another request of the same run was in flight
when it was sent: some other request j has ``launch_j <= launch_i <
finish_j`` (sent at or before it, its last token not yet received). Otherwise
it arrived **alone**. A request in flight may be prefilling or decoding;
either way the engine's steps are shared, so the new prefill waits or runs
slower. The mean TTFT of a round mixes both: in a multi-round chat a
returning user's round often arrives while new users' first rounds prefill,
and then its TTFT is mostly queueing, whatever a cache hit saved. Split by
arrival, the ``alone`` rows show what a hit saves, the ``queued`` rows what
it saves under load. The classes come from each run's own timings, so a
slower server finds more of the same requests queued.
"""

from __future__ import annotations

from bisect import bisect_right

import numpy as np

ALONE, QUEUED = "alone", "queued"
ALL = "all"
CLASSES = (ALL, ALONE, QUEUED)


def others_in_flight(results) -> list[int]:
    """For each result (in the given order), how many other requests of the
    run were in flight when it was sent: sent at or before its launch and
    finished after it (a finish at the very instant of a launch is not in
    flight, as in ``client.concurrency``)."""
    launches = sorted(r.launch_time for r in results)
    finishes = sorted(r.finish_time for r in results)
    # every request that finished by t was also sent by t (finish > launch),
    # so the difference counts those sent by t and still running, itself included
    return [
        max(
            0,
            bisect_right(launches, r.launch_time)
            - bisect_right(finishes, r.launch_time)
            - (r.finish_time > r.launch_time),
        )
        for r in results
    ]


def arrival_classes(results) -> list[str]:
    return [QUEUED if n else ALONE for n in others_in_flight(results)]


def ttft_stats(ttfts: list[float]) -> dict:
    """requests, mean, p50 and p90 TTFT in seconds (numpy's percentiles, as the
    summary's); None without requests (null in the summary's JSON)."""
    if not ttfts:
        return {"requests": 0, "ttft_mean_s": None, "ttft_p50_s": None, "ttft_p90_s": None}
    return {
        "requests": len(ttfts),
        "ttft_mean_s": sum(ttfts) / len(ttfts),
        "ttft_p50_s": float(np.percentile(ttfts, 50)),
        "ttft_p90_s": float(np.percentile(ttfts, 90)),
    }


def ttft_by_round_arrival(results) -> dict:
    """{round: {"all" | "alone" | "queued": ttft_stats}}, rounds as strings
    (``question_id``: a user's n-th question, or a doc-qa pass) in order, then
    "all" for every round together."""
    groups: dict[str, dict[str, list[float]]] = {}
    for r, cls in zip(results, arrival_classes(results)):
        for key in (str(r.question_id), ALL):
            by = groups.setdefault(key, {c: [] for c in CLASSES})
            by[ALL].append(r.ttft)
            by[cls].append(r.ttft)
    order = sorted((k for k in groups if k != ALL), key=int) + ([ALL] if groups else [])
    return {k: {c: ttft_stats(groups[k][c]) for c in CLASSES} for k in order}
