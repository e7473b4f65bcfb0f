"""Two correctness guards on vLLM's real Scheduler:

- tensor parallelism: a load that fails on one rank is never committed as
  good, even when vLLM reports it finished steps later (after the last rank),
  driven through vLLM's own ``KVOutputAggregator``;
- a connector reset forgets the host tier and the stores in flight, and keys
  stay a function of the weights the workers run: a lower tier's pages of
  the same weights are served again, of other weights never (a real
  DiskStore writes the files, real ``LoadedWeights`` label real modules).
"""

from __future__ import annotations


import torch
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.request import RequestStatus

from helpers.scheduler_harness import (
    BLOCK,
    keys_of,
    kvbm,
    lookup,
    make_request,
    make_scheduler,
    step,
    step_with_weights,
    store_and_finish,
    tokens,
    worker_output,
    worker_weights,
)
from helpers.tier_pages import disk_store_for, put_where_the_scheduler_sees, tier_of


def tp_step(sched, aggregator, *ranks: dict):
    """One step whose worker output comes from one fake worker per TP rank,
    combined by vLLM's own aggregator as its executor does."""
    out = sched.schedule()
    mro = aggregator.aggregate([worker_output(sched, out, **kw) for kw in ranks])
    sched.update_from_output(out, mro)
    return out, out.kv_connector_metadata


def test_a_rank_that_fails_its_load_steps_before_the_other_finishes_commits_nothing():
    s = make_scheduler(tensor_parallel_size=2)
    k = kvbm(s)
    agg = KVOutputAggregator(expected_finished_count=2)
    prompt = tokens(40, 61)  # two full blocks
    r1 = make_request(prompt, max_tokens=1)
    s.add_request(r1)
    for _ in range(10):  # both ranks finish every store and free within the step
        if r1.request_id not in s.requests:
            break
        tp_step(s, agg, dict(complete=True), dict(complete=True))
    keys = keys_of(s, prompt)[:2]
    assert all(k.host.is_ready(key) for key in keys)
    assert s.reset_prefix_cache()  # vLLM's own cache forgets: the host tier must serve

    r2 = make_request(prompt, max_tokens=2)
    s.add_request(r2)
    # Step 1: the load is planned; rank 1's copy fails at once, rank 0's is running.
    out = s.schedule()
    (load,) = out.kv_connector_metadata.loads
    rank0 = worker_output(s, out)
    rank1 = worker_output(
        s,
        out,
        loads_failed=[r2.request_id],
        finished_recving=[r2.request_id],
        invalid_block_ids=load.block_ids,
    )
    s.update_from_output(out, agg.aggregate([rank0, rank1]))
    assert r2.status == RequestStatus.WAITING_FOR_REMOTE_KVS  # rank 0 still loading
    # Step 2: rank 0 finishes fine; vLLM now reports the load finished.
    out, _ = tp_step(s, agg, dict(finished_recving=[r2.request_id]), dict())
    # Nothing of that load is trusted: rank 1's slots hold unknown bytes.
    assert not any(k.host.is_ready(key) for key in keys)
    assert k.get_num_new_matched_tokens(make_request(prompt), 0) == (0, False)
    assert k.stats.total["load_error_blocks"] == 2
    assert k.stats.total["onboard_blocks_h2d"] == 0
    # vLLM recomputes the whole prompt (both ranks' failure policy: recompute).
    out, _ = tp_step(s, agg, dict(complete=True), dict(complete=True))
    assert out.num_scheduled_tokens.get(r2.request_id) == 40
    for _ in range(10):
        if r2.request_id not in s.requests:
            break
        tp_step(s, agg, dict(complete=True), dict(complete=True))
    # Recomputed KV is stored again, and serves the next request.
    assert all(k.host.is_ready(key) for key in keys)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))


def test_after_a_reset_a_lower_tiers_pages_are_served_under_the_same_weights_only(tmp_path):
    s = make_scheduler(host_blocks=8, disk_cache_dir=str(tmp_path), disk_cache_size="64MiB")
    k = kvbm(s)
    model = _model()
    worker = worker_weights(model)
    store = disk_store_for(k, tmp_path)
    try:
        prompt = tokens(2 * BLOCK + 5, 62)
        old_keys = keys_of(s, prompt)[:2]
        put_where_the_scheduler_sees(store, k, old_keys)
        assert lookup(k, make_request(prompt))[0] == 2 * BLOCK

        # The same weights: the workers' digest is "as loaded", the keys are
        # the ones before the reset, and the disk's pages are served again.
        assert s.reset_prefix_cache(reset_connector=True)
        _, meta, served = step_with_weights(s, [worker])
        assert meta.weights == (1, ("",)) and served == [True]  # one epoch per reset
        assert keys_of(s, prompt)[:2] == old_keys
        assert lookup(k, make_request(prompt))[0] == 2 * BLOCK

        # Weights updated in memory, then a reset: once the workers' labels
        # are in, the keys name them, and the pages of the weights before are
        # never looked up.
        update(worker, model, 2.0)
        assert s.reset_prefix_cache(reset_connector=True)
        assert step_with_weights(s, [worker])[2] == [False]  # jobs under the old keys
        new_keys = keys_of(s, prompt)[:2]
        assert not set(new_keys) & set(old_keys)
        assert lookup(k, make_request(prompt)) == (0, False)
        assert all(tier_of(k.lower, key) == "disk" for key in old_keys)  # still there
        # What is computed now is cached under the new keys.
        store_and_finish(s, prompt)
        assert all(k.host.is_ready(key) for key in new_keys)

        # The files loaded at startup reloaded: the pages stored before are
        # found again.
        update(worker, model, 0.5, label="")
        assert s.reset_prefix_cache(reset_connector=True)
        step_with_weights(s, [worker])
        assert keys_of(s, prompt)[:2] == old_keys
        assert lookup(k, make_request(prompt))[0] == 2 * BLOCK
    finally:
        store.close()


def test_a_connector_reset_alone_starts_a_weights_epoch_whose_loads_wait_for_the_digest(tmp_path):
    """vLLM may call the connector's reset without (or before) the hook on
    its own prefix-cache reset: the reset starts the weights epoch itself, and
    a load of the keys from before, planned before the workers' digests are
    in, is refused by a worker whose weights differ from the keys'."""
    s = make_scheduler(host_blocks=8, disk_cache_dir=str(tmp_path), disk_cache_size="64MiB")
    k = kvbm(s)
    del s.kv_cache_manager.reset_prefix_cache  # vLLM's own method, unhooked
    model = _model()
    worker = worker_weights(model)
    store = disk_store_for(k, tmp_path)
    try:
        prompt = tokens(2 * BLOCK + 5, 66)
        put_where_the_scheduler_sees(store, k, keys_of(s, prompt)[:2])
        with torch.no_grad():
            model[0].bias.add_(1)
        assert s.reset_prefix_cache(reset_connector=True)
        req = make_request(prompt, max_tokens=1)
        assert lookup(k, req)[0] == 2 * BLOCK  # the keys of the weights as loaded
        s.add_request(req)
        _, meta, served = step_with_weights(s, [worker])
        assert meta.loads and meta.weights == (1, ("",))
        assert served == [False]  # refused: recomputed, never onboarded
        assert keys_of(s, prompt)[:2] != keys_of(make_scheduler(), prompt)[:2]
    finally:
        store.close()


def test_engines_that_received_the_same_update_and_reset_share_keys():
    engines = [make_scheduler() for _ in range(3)]
    prompt = tokens(3 * BLOCK, 67)
    before = keys_of(engines[0], prompt)
    updates = (2.0, 2.0, 3.0)  # the third engine received another update
    for sched, scale in zip(engines, updates):
        model = _model()
        worker = worker_weights(model)
        update(worker, model, scale)
        assert sched.reset_prefix_cache(reset_connector=True)
        step_with_weights(sched, [worker])
    a, b, c = (keys_of(sched, prompt) for sched in engines)
    assert a == b  # the same update: shared pages
    assert a != before and c != a and c != before


def update(worker, model, scale: float, label: str | None = None) -> None:
    """An update KVBM identifies, as vLLM's update_weights runs it: the
    model's LayerNorm weight scaled, loaded as a (name, tensor) pair the
    worker digests (``label`` "": a reload of the files loaded at startup)."""
    from vllm_kvbm.worker.weight_digests import LoadDigest

    base = worker.begin_change("update_weights")
    digest = LoadDigest()
    with torch.no_grad():
        for name, tensor in digest.passing([("1.weight", model[1].weight * scale)]):
            model[1].weight.copy_(tensor)
    if label is None:
        label = worker.load_label(base, digest, [])
    worker.end_change(label, "update_weights", digest.names)


def test_a_reset_vllm_refused_is_refused_by_kvbm_too():
    """vLLM calls the connector's reset even when its own failed (a running
    request holds blocks): its cached blocks keep serving pre-reset KV, so
    pages computed on top of them must never get post-reset keys. KVBM then
    refuses the reset as a whole: the keys, the host tier and every store
    stay as they were, until a reset vLLM grants."""
    s = make_scheduler(max_batched=BLOCK)  # one block of prefill per step
    k = kvbm(s)
    prompt = tokens(3 * BLOCK + 1, 63)
    r1 = make_request(prompt, max_tokens=2)
    s.add_request(r1)
    _, meta, _ = step(s, complete=True)
    assert r1.num_computed_tokens == BLOCK and meta.stores  # block 0 stored
    keys = keys_of(s, prompt)
    assert k.host.is_ready(keys[0])

    assert not s.reset_prefix_cache(reset_connector=True)  # r1 holds blocks
    assert keys_of(s, prompt) == keys  # no new epoch
    assert k.host.is_ready(keys[0])  # nothing forgotten
    # A newcomer sharing the prefix hits vLLM's stale block 0 and stores what
    # it computes on top of it: under the keys that KV was computed for.
    r2 = make_request(prompt[: 2 * BLOCK + 1] + tokens(BLOCK, 64), max_tokens=1)
    s.add_request(r2)
    stores = 0
    for _ in range(30):
        if r1.request_id not in s.requests and r2.request_id not in s.requests:
            break
        _, meta, _ = step(s, complete=True)
        stores += len(meta.stores)
    assert stores and keys_of(s, prompt) == keys
    r2_keys = keys_of(s, r2.prompt_token_ids)
    assert r2_keys[0] == keys[0] and all(k.host.is_ready(key) for key in r2_keys)

    # With every request done, vLLM's reset succeeds and so does KVBM's
    # (the weights unchanged: the same keys, the host tier cleared).
    assert s.reset_prefix_cache(reset_connector=True)
    assert keys_of(s, prompt) == keys
    assert not any(k.host.is_ready(key) for key in keys)


def test_a_request_preempted_by_a_reset_stores_only_recomputed_kv():
    """reset_running_requests: vLLM preempts every running request, resets,
    and they recompute from scratch; the host tier's pages from before are
    gone, and what they store then is the recomputed KV (under the same keys:
    the weights did not change)."""
    s = make_scheduler(max_batched=BLOCK)
    k = kvbm(s)
    prompt = tokens(3 * BLOCK + 1, 65)
    r1 = make_request(prompt, max_tokens=2)
    s.add_request(r1)
    _, meta, _ = step(s, complete=True)
    old = keys_of(s, prompt)
    assert meta.stores and k.host.is_ready(old[0])
    assert s.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
    assert not k.host.is_ready(old[0])
    for _ in range(30):
        if r1.request_id not in s.requests:
            break
        step(s, complete=True)
    new = keys_of(s, prompt)
    assert new == old
    assert all(k.host.is_ready(key) for key in new[:3])
