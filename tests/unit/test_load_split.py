"""The load/recompute split: learned costs, the cut, and its effect on vLLM's scheduler.

The cost model is checked on its own (fits, cuts, probes); the scheduler
side on vLLM's real Scheduler with costs it learned from observations fed
through the same calls the planner makes; real engines in
tests/e2e/test_load_split_e2e.py.
"""

from __future__ import annotations

from collections import Counter

import pytest

from helpers.scheduler_harness import BLOCK, admit, kvbm, make_request, make_scheduler
from helpers.scheduler_harness import store_and_finish, tokens
from vllm_kvbm.config import KVBMConfigError, load_config
from vllm_kvbm.scheduler.load_split import PROBE_AFTER_S, PROBE_BLOCKS, LoadSplit, PrefillModel


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_prefill_model_recovers_linear_and_attention_parts():
    model = PrefillModel()
    a, b = 2e-4, 1e-8
    for start, n in [(0, 512), (0, 2048), (1024, 1024), (4096, 512), (0, 8192)]:
        model.add(start, n, a * n + b * n * (2 * start + n) / 2)
    assert model.a == pytest.approx(a, rel=1e-3)
    assert model.b == pytest.approx(b, rel=1e-3)
    # Later blocks cost more to recompute (attention over a longer prefix).
    assert model.block_seconds(60, BLOCK) > model.block_seconds(0, BLOCK)


def test_prefill_model_with_one_shape_falls_back_to_a_per_token_cost():
    model = PrefillModel()
    for _ in range(3):
        model.add(0, 1024, 0.5)
    assert model.block_seconds(0, 128) > 0
    assert model.a >= 0 and model.b >= 0


def learned(split: LoadSplit, seconds_per_token: float = 1e-3, **tiers: float) -> LoadSplit:
    """``split`` after two prefills and one load per tier at these costs."""
    for n in (1024, 2048):
        split.prefill_done(0, n, n * seconds_per_token)
    for tier, per_block in tiers.items():
        split.load_done(Counter({tier: 4}), 4 * per_block)
    return split


def test_everything_is_loaded_until_both_costs_are_known():
    split = LoadSplit(128, clock=Clock())
    sources = ["host"] * 2 + ["remote"] * 4
    assert split.cut(sources, 0) == 6  # nothing learned
    split.load_done(Counter({"remote": 4}), 40.0)  # a very slow tier...
    assert split.cut(sources, 0) == 6  # ...but recompute's cost is not known yet
    split.prefill_done(0, 1024, 1.0)
    split.prefill_done(0, 2048, 2.0)
    assert split.cut(sources, 0) == 2


def test_a_slow_tier_is_recomputed_a_fast_one_loaded():
    split = learned(LoadSplit(128, clock=Clock()), host=0.001, disk=0.01, remote=1.0)
    # recompute: 0.128 s per block; remote 1 s, disk 0.01 s
    assert split.cut(["host"] * 3 + ["disk"] * 5, 0) == 8
    assert split.cut(["host"] * 3 + ["remote"] * 5, 0) == 3
    assert split.cut(["remote"] * 5, 0) == 0
    assert split.cut(["host", "disk", "remote", "remote"], 0) == 2


def test_off_loads_everything():
    split = learned(LoadSplit(128, enabled=False, clock=Clock()), remote=1.0)
    assert split.cut(["remote"] * 5, 0) == 5


def test_a_slow_remote_part_worth_it_behind_a_long_fast_part():
    """The cut minimises the whole prefix's cost: a slow block is still loaded
    when what comes after it saves more than it costs."""
    split = learned(LoadSplit(128, clock=Clock()), disk=0.0, remote=0.2)
    # remote 0.2 s vs recompute 0.128 s: alone it is cut...
    assert split.cut(["remote"], 0) == 0
    # ...but the load is one piece: a slow block then many cheap ones pays off.
    assert split.cut(["remote"] + ["disk"] * 4, 0) == 5


def test_a_tier_found_slow_is_probed_again_later_by_one_request():
    clock = Clock()
    split = learned(LoadSplit(128, clock=clock), remote=1.0)
    assert split.cut(["remote"] * 8, 0) == 0
    clock.now += PROBE_AFTER_S + 1
    # stale: this request measures it again, with its first few blocks only
    assert split.cut(["remote"] * 8, 0) == PROBE_BLOCKS
    assert split.cut(["remote"] * 4, 0) == 0  # the next ones do not, meanwhile
    split.load_done(Counter({"remote": 4}), 4 * 0.01)  # it got fast
    split.load_done(Counter({"remote": 4}), 4 * 0.01)
    split.load_done(Counter({"remote": 4}), 4 * 0.01)
    split.load_done(Counter({"remote": 4}), 4 * 0.01)
    split.load_done(Counter({"remote": 4}), 4 * 0.01)
    split.load_done(Counter({"remote": 4}), 4 * 0.01)
    assert split.cut(["remote"] * 4, 0) == 4


def test_a_lower_tier_cost_excludes_the_host_part_of_its_load():
    split = LoadSplit(128, clock=Clock())
    split.load_done(Counter({"host": 10}), 10 * 0.002)
    split.load_done(Counter({"host": 10, "disk": 5}), 10 * 0.002 + 5 * 0.03)
    assert split.seconds_per_block("host") == pytest.approx(0.002)
    assert split.seconds_per_block("disk") == pytest.approx(0.03)


def test_a_tiers_cost_separates_its_latency_from_its_time_per_page():
    """Loads of 2 and 10 pages at 0.3 s + 0.01 s a page: a fixed latency and
    a time per page, not one cost per page (which would make long loads
    look 4x dearer per page than they are, or short ones cheaper)."""
    split = LoadSplit(128, clock=Clock())
    split.load_done(Counter({"remote": 2}), 0.3 + 2 * 0.01)
    split.load_done(Counter({"remote": 10}), 0.3 + 10 * 0.01)
    cost = split.load["remote"]
    assert cost.latency == pytest.approx(0.3)
    assert cost.per_page == pytest.approx(0.01)
    assert split.load_seconds("remote", 40) == pytest.approx(0.7)
    # the newest loads weigh most: a link that got slower is followed
    for _ in range(6):
        split.load_done(Counter({"remote": 2}), 0.3 + 2 * 0.05)
        split.load_done(Counter({"remote": 10}), 0.3 + 10 * 0.05)
    assert split.load["remote"].per_page == pytest.approx(0.05, rel=0.05)


def test_the_cut_pays_a_tiers_latency_once_and_stays_a_prefix():
    """Recompute 0.128 s a page; remote 0.5 s latency + 0.01 s a page: a few
    remote pages are not worth the latency, many are; host pages before them
    are loaded either way, and nothing after a recomputed page is loaded."""
    split = learned(LoadSplit(128, clock=Clock()), host=0.001)
    split.load_done(Counter({"remote": 2}), 0.5 + 2 * 0.01)
    split.load_done(Counter({"remote": 20}), 0.5 + 20 * 0.01)
    assert split.cut(["host"] * 2 + ["remote"] * 2, 0) == 2
    assert split.cut(["host"] * 2 + ["remote"] * 20, 0) == 22
    assert split.cut(["remote"] * 20, 0) == 20


def test_loads_sharing_a_tier_are_fitted_and_costed_with_the_loads_ahead():
    """The tier reads one load at a time: a 4-page load behind one of 20
    pages ends after both latencies and 24 pages. Fitted with what was
    ahead, the tier's own cost is found (not a tier 6x slower); asked with a
    20-page load in flight, 4 pages are not worth waiting for, alone they are."""
    split = learned(LoadSplit(128, clock=Clock()))
    split.load_done(Counter({"remote": 20}), 0.05 + 20 * 0.02)
    split.load_done(Counter({"remote": 4}), 2 * 0.05 + 24 * 0.02, {"remote": (1, 20)})
    cost = split.load["remote"]
    assert cost.latency == pytest.approx(0.05)
    assert cost.per_page == pytest.approx(0.02)
    assert split.cut(["remote"] * 4, 0) == 4  # 0.13 s against 0.512 s of recompute
    assert split.cut(["remote"] * 4, 0, {"remote": (1, 20)}) == 0  # 0.58 s: recompute


def test_load_split_config():
    assert load_config({}, {}).load_split is True
    assert load_config({"load_split": False}, {}).load_split is False
    assert load_config({}, {"KVBM_LOAD_SPLIT": "off"}).load_split is False
    with pytest.raises(KVBMConfigError, match="load_split"):
        load_config({"load_split": "sometimes"}, {})


# ---- on vLLM's real Scheduler --------------------------------------------------


def run(sched, toks):
    """Runs a request to completion; its lookup may take a few steps (a
    background thread asks the disk)."""
    return store_and_finish(sched, toks)[0]


def test_scheduler_loads_the_host_part_and_recomputes_a_slow_remainder(tmp_path):
    """Blocks 0-1 in the host tier, 2-5 only on disk; disk learned slower than
    recompute: vLLM is told of 2 blocks, computes the rest, and the counters
    say which tokens were recomputed on purpose."""
    from helpers.tier_pages import disk_store_for, put_where_the_scheduler_sees

    s = make_scheduler(
        host_blocks=64, disk_cache_dir=str(tmp_path), disk_cache_size="64MiB", load_split=True
    )
    k = kvbm(s)
    # Prefill costs come from the scheduler's own timing of real steps.
    run(s, tokens(4 * BLOCK + 3, 2))
    run(s, tokens(6 * BLOCK + 3, 3))
    assert k.split.prefill.samples == 2
    recompute = k.split.prefill.block_seconds(0, BLOCK)
    assert recompute > 0
    prompt = tokens(6 * BLOCK + 5, 1)
    run(s, prompt[: 2 * BLOCK + 1])  # blocks 0-1 in the host tier
    assert s.reset_prefix_cache()
    disk = disk_store_for(k, tmp_path)
    try:
        chain_keys = _keys(k, prompt)
        put_where_the_scheduler_sees(disk, k, chain_keys[2:6])
    finally:
        disk.close()
    k.split.load_done(Counter({"disk": 4}), 4 * recompute * 50)  # disk: 50x recompute
    # The lookup waits for the disk's answer however long (this is about the
    # split; the harness's step times make recompute look nearly free, and a
    # busy machine answers later than that: tests/e2e/test_wait_bound.py).
    k.split.wait_bound = lambda start, count: None

    before = Counter(k.stats.total)
    req = make_request(prompt, max_tokens=2)
    s.add_request(req)
    _, meta, _ = admit(s, req)
    (load,) = meta.loads
    assert len(load.block_ids) == 2 and not load.fetch  # the host blocks only
    total = k.stats.total
    assert total["matched_tokens_host"] - before["matched_tokens_host"] == 2 * BLOCK
    assert total["matched_tokens_disk"] - before["matched_tokens_disk"] == 0
    assert total["recompute_chosen_tokens"] - before["recompute_chosen_tokens"] == 4 * BLOCK

    # With the split off the same disk pages are loaded.
    k.split.enabled = False
    req2 = make_request(prompt, max_tokens=2)
    s.add_request(req2)
    _, meta, _ = admit(s, req2)
    assert any(len(job.fetch) == 4 for job in meta.loads)


def _keys(k, toks):
    return list(k.key_chain(make_request(toks)).extend(toks))
