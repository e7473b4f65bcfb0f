"""``kvbm-bench compare``'s plots, one figure per question, 1200 x 675 pixels:

- ``ttft_per_round.png``: does TTFT fall as prompts return? Mean TTFT per
  round (multi-round: a user's n-th question) or pass (doc-qa), per
  configuration;
- ``ttft_by_arrival.png``: what does a hit save apart from queueing? The same
  per round, in two panels: requests that arrived alone, and those queued
  behind another request in flight (``arrivals.py``);
- ``hit_tokens.png``: where did the prompt tokens come from? Per
  configuration, the tokens vLLM's own prefix cache served, those each KVBM
  tier (or LMCache) served, and those computed;
- ``ttft_distribution.png``: how are the TTFTs of each configuration spread?
"""

from __future__ import annotations

from pathlib import Path

from vllm_kvbm.bench.arrivals import ALL, ALONE, QUEUED

SIZE, DPI = (8, 4.5), 150


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    return path


def _log_if_wide(ax, values: list[float]) -> str:
    """A log axis when the values span more than 20x (a miss and a hit)."""
    pos = [v for v in values if v > 0]
    if pos and max(pos) > 20 * min(pos):
        ax.set_yscale("log")
        return ", log scale"
    return ""


def ttft_per_round(plt, runs, path: Path, workload: str) -> Path | None:
    ok = [r for r in runs if r.summary.get("ttft_mean_by_round_s")]
    if not ok:
        return None
    fig, ax = plt.subplots(figsize=SIZE)
    values = []
    for r in ok:
        by = sorted((int(k), v * 1000) for k, v in r.summary["ttft_mean_by_round_s"].items())
        ax.plot([k for k, _ in by], [v for _, v in by], marker="o", label=r.label)
        values += [v for _, v in by]
    what = (
        "round (a user's n-th question; 0: first time)"
        if workload == "multi-round"
        else "pass over the documents (0: first time)"
    )
    ax.set_xlabel(what)
    ax.set_ylabel(f"mean TTFT (ms{_log_if_wide(ax, values)})")
    ax.set_title("Time to first token as prompts return")
    ax.set_xticks(sorted({int(k) for r in ok for k in r.summary["ttft_mean_by_round_s"]}))
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def ttft_by_arrival(plt, runs, path: Path, workload: str) -> Path | None:
    ok = [r for r in runs if r.summary.get("ttft_by_round_arrival")]
    if not ok:
        return None
    fig, axes = plt.subplots(1, 2, figsize=SIZE, sharey=True)
    values, rounds = [], set()
    for i, r in enumerate(ok):
        split = r.summary["ttft_by_round_arrival"]
        for ax, cls in zip(axes, (ALONE, QUEUED)):
            pts = sorted(
                (int(k), by[cls]["ttft_mean_s"] * 1000, by[cls]["requests"])
                for k, by in split.items()
                if k != ALL and by[cls]["requests"]
            )
            ax.plot(
                [k for k, _, _ in pts],
                [v for _, v, _ in pts],
                marker="o",
                color=f"C{i}",
                label=r.label,
            )
            for k, v, n in pts:  # the classes' sizes differ between configurations
                ax.annotate(
                    f"{n}",
                    (k, v),
                    textcoords="offset points",
                    xytext=(5, 4),
                    fontsize=7,
                    color=f"C{i}",
                )
            values += [v for _, v, _ in pts]
            rounds |= {k for k, _, _ in pts}
    scale = _log_if_wide(axes[0], values)
    what = "round" if workload == "multi-round" else "pass"
    for ax, title in zip(axes, ("arrived alone", "queued behind a request in flight")):
        ax.set_title(title)
        ax.set_xlabel(f"{what} (0: first time)")
        ax.set_xticks(sorted(rounds))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"mean TTFT (ms{scale}; beside each point: requests)")
    axes[0].legend()
    return _save(fig, path)


def hit_tokens(plt, runs, path: Path) -> Path | None:
    ok = [r for r in runs if r.counters.get("prefix_queries")]
    if not ok:
        return None
    found = []
    for r in ok:
        c = r.counters
        one = {"vLLM's prefix cache": c["prefix_hits"]}
        one.update({f"KVBM {t} tier": n for t, n in c.get("kvbm_tokens", {}).items()})
        if "lmcache_hit_tokens" in c:
            one["LMCache"] = c["lmcache_hit_tokens"]
        one["computed (prefill)"] = max(0.0, c["prefix_queries"] - sum(one.values()))
        found.append(one)
    names = list(
        dict.fromkeys(
            n for one in found for n, count in one.items() if count and n != "computed (prefill)"
        )
    )
    parts = {n: [one.get(n, 0.0) for one in found] for n in [*names, "computed (prefill)"]}
    fig, ax = plt.subplots(figsize=SIZE)
    x = range(len(ok))
    bottom = [0.0] * len(ok)
    for name, counts in parts.items():
        ax.bar(
            x,
            counts,
            bottom=bottom,
            label=name,
            width=0.6,
            color="lightgray" if name.startswith("computed") else None,
        )
        bottom = [b + n for b, n in zip(bottom, counts)]
    ax.set_xticks(list(x), [r.label for r in ok], rotation=15, ha="right")
    ax.set_ylabel("prompt tokens (workload, warm-up excluded)")
    ax.set_title("Where the prompt tokens came from")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
    return _save(fig, path)


def ttft_distribution(plt, runs, path: Path) -> Path | None:
    ok = [r for r in runs if r.results]
    if not ok:
        return None
    fig, ax = plt.subplots(figsize=SIZE)
    data = [[x.ttft * 1000 for x in r.results] for r in ok]
    ax.boxplot(data, showfliers=False)
    for i, d in enumerate(data, start=1):
        ax.scatter([i + (j % 5 - 2) * 0.04 for j in range(len(d))], d, s=10, alpha=0.6)
    ax.set_xticks(range(1, len(ok) + 1), [r.label for r in ok], rotation=15, ha="right")
    ax.set_ylabel(f"TTFT per request (ms{_log_if_wide(ax, [v for d in data for v in d])})")
    ax.set_title("Time to first token of every request")
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def plots(runs, out_dir: Path, workload: str) -> list[Path]:
    plt = _pyplot()
    made = []
    for draw in (
        lambda: ttft_per_round(plt, runs, out_dir / "ttft_per_round.png", workload),
        lambda: ttft_by_arrival(plt, runs, out_dir / "ttft_by_arrival.png", workload),
        lambda: hit_tokens(plt, runs, out_dir / "hit_tokens.png"),
        lambda: ttft_distribution(plt, runs, out_dir / "ttft_distribution.png"),
    ):
        path = draw()
        plt.close("all")
        if path is not None:
            made.append(path)
    return made
