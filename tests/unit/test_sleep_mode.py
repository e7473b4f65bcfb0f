"""vLLM's sleep mode against KVBM's worker, without an engine: the KV memory
released and restored (worker/kv_release.py) on the real worker (real
tensors, real NIXL), vLLM's sleep, wake_up and discard followed through
vLLM's own collective_rpc dispatch (worker/sleep_mode.py), and the weights'
label at each sleep level (worker/loaded_weights.py).

Sleep itself cannot happen here (vLLM's CPU worker ignores it): the stand-in
worker's ``sleep`` does what vLLM's cumem allocator does to the memory: the
KV cache's bytes are gone (overwritten) while the addresses stay, and at
level 2 the weights' bytes too.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import torch

from helpers.kv_layouts import random_fill
from test_weight_changes import Model, Runner, Worker, _multiproc, _reset, _scale_norm, _uniproc
from test_weight_changes import checkpoints  # noqa: F401 (fixture)
from test_worker_unit import ManualFence, StuckNixl, gen, harness, split  # noqa: F401 (fixtures)
from vllm_kvbm.messages import KVBMConnectorMetadata, TransferJob
from vllm_kvbm.worker import loaded_weights
from vllm_kvbm.worker.fence import DONE
from vllm_kvbm.worker.kv_release import KVMemoryBusy
from vllm_kvbm.worker.loaded_weights import LoadedWeights
from vllm_kvbm.worker.weight_digests import DigestStopped


def _stores(h, *jobs, free=True) -> None:
    h.worker.start_stores(
        KVBMConnectorMetadata(
            stores=[TransferJob(i, r, b, s) for i, r, b, s in jobs],
            delayed_free_req_ids=[r for _, r, _, _ in jobs] if free else [],
        )
    )


def _load(h, job_id: int, req: str, blocks, slots) -> None:
    h.worker.start_loads(KVBMConnectorMetadata(loads=[TransferJob(job_id, req, blocks, slots)]))


def _suspend(h, gen) -> None:
    """What sleep does to the KV memory: its bytes are gone, the addresses stay."""
    for t in h.lay.raw:
        random_fill(t, gen)


# ---- the release, on the real worker ------------------------------------------------


def test_a_release_finishes_posted_stores_fails_queued_ones_and_a_load_after_restore_lands(
    harness, gen
):
    h = harness()
    (ba, sa), (bb, sb), (bl, _) = split(gen, 3, 24)
    _stores(h, (1, "A", ba, sa))  # posted at once (the CPU fence is done)
    fence = ManualFence()
    h.worker.make_fence = lambda: fence
    _stores(h, (2, "B", bb, sb))  # queued behind a fence the engine has not passed
    b_rows = h.pool[sb].clone()
    assert h.worker._inflight and h.worker._pending

    h.worker.release_kv("sleep(level=1)")
    # A ended first, B was never posted (and its fence never waited on).
    assert not h.worker._inflight and not h.worker._pending and fence.waits == 0
    h.step()
    assert h.meta.stores_done == Counter({1: 1}) and h.meta.stores_failed == Counter({2: 1})
    assert h.pool_holds(ba, sa) and torch.equal(h.pool[sb], b_rows)
    assert sorted(h.sending) == ["A", "B"]  # their blocks may be freed

    # Until restore, every job is refused before it touches the memory.
    h.worker.make_fence = lambda: DONE
    kv_before = h.lay.clone_raw()
    _load(h, 3, "L", bl, sa)
    _stores(h, (4, "C", bl, sb))
    h.step_until(lambda: "L" in h.recving)
    assert h.meta.loads_failed == Counter({"L": 1}) and h.meta.stores_failed[4] == 1
    assert h.worker.get_block_ids_with_load_errors() == set(bl)  # vLLM recomputes them
    assert h.lay.raw_equal(kv_before) and torch.equal(h.pool[sb], b_rows)

    _suspend(h, gen)
    h.worker.restore_kv()
    _load(h, 5, "R", bl, sa)  # A's pages into blocks whose bytes sleep replaced
    h.step_until(lambda: "R" in h.recving)
    assert h.pool_holds(bl, sa) and h.meta.loads_failed == Counter({"L": 1})
    fence.is_done = True  # B's fence passes after all: it stays unposted
    for _ in range(5):
        h.step()
    assert torch.equal(h.pool[sb], b_rows) and h.meta.stores_done == Counter({1: 1})


def test_a_transfer_past_its_timeout_fails_the_release_and_nothing_is_released(harness, gen):
    h = harness()
    stuck = StuckNixl(h.worker, timeout_s=0.1)
    ((b, s),) = split(gen, 1, 16)
    t = time.perf_counter()  # (the store's timeout runs from its post)
    _stores(h, (1, "S", b, s))
    with pytest.raises(
        KVMemoryBusy,
        match=r"\(sleep\(level=2\)\): 1 transfer\(s\) .* still "
        r"running after the transfer timeout \(0\.1 s.*"
        r"request S\)\. Nothing was released.*restart",
    ):
        h.worker.release_kv("sleep(level=2)")
    assert stuck.timeout_s <= time.perf_counter() - t < 5.0  # bounded by the timeout
    assert h.worker.kv_released is None  # vLLM frees nothing and runs on: so do the copies
    stuck.end()
    h.step_until(lambda: h.meta.slots_released == Counter(s))  # the late store ended
    h.worker.release_kv("sleep(level=2)")
    assert h.worker.kv_released == "sleep(level=2)"
    h.worker.release_kv("sleep(level=2)")  # again (vLLM >= 0.33 calls it too): nothing to do


# ---- vLLM's calls, through its own dispatch ------------------------------------------


class SleepingWorker(Worker):
    """vLLM's worker with sleep mode: ``sleep`` frees the memory as the cumem
    allocator does (the KV cache's bytes gone; at level 2 the weights' too),
    noting what KVBM's copies were doing at that moment."""

    def __init__(self, model, path, kv=None, lay=None, gen=None):
        super().__init__(model, path)
        self.model_runner = SleepingRunner(model, kv)
        self.lay, self.gen, self.kv = lay, gen, kv
        self.calls: list[tuple] = []

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level, self._copies()))
        if self.lay is not None:
            for t in self.lay.raw:
                random_fill(t, self.gen)
        if level == 2:
            with torch.no_grad():
                for p in self.model_runner.get_model().parameters():
                    p.normal_()

    def wake_up(self, tags=None) -> None:
        self.calls.append(("wake_up", tags, self._copies()))

    def discard(self, tags) -> None:
        self.calls.append(("discard", tuple(tags), self._copies()))

    def _copies(self):
        kv = self.kv
        if hasattr(kv, "_inflight"):
            return kv.kv_released, len(kv._inflight) + len(kv._pending)
        return kv.calls[-1] if kv is not None and kv.calls else None


class SleepingRunner(Runner):
    def __init__(self, model, kv):
        super().__init__(model)
        self.kv = kv

    def initialize_kv_cache(self):  # as the connector's register_kv_caches does
        self.weights = LoadedWeights.from_vllm(0, kv=self.kv)


def test_vllms_sleep_releases_the_kv_memory_before_it_goes_and_wake_up_restores_it(
    harness, gen, checkpoints
):
    """vLLM 0.32 calls the connector at neither: the worker's sleep,
    wake_up and discard are followed (vLLM's multiprocessing dispatch)."""
    orig, _ = checkpoints
    h = harness()
    (ba, sa), (bb, sb), (bl, _) = split(gen, 3, 16)
    worker = SleepingWorker(Model(), orig, h.worker, h.lay, gen)
    rpc, weights = _multiproc(worker)
    h.worker.weights = weights
    _stores(h, (1, "A", ba, sa))
    fence = ManualFence()
    h.worker.make_fence = lambda: fence
    _stores(h, (2, "B", bb, sb))

    rpc("sleep", kwargs={"level": 1})  # as vLLM's executor sends it
    # The memory went once nothing was copying and nothing could start.
    assert worker.calls == [("sleep", 1, ("sleep(level=1)", 0))]
    assert weights.label == "" and weights.take_unreported() == []  # level 1: the same weights
    h.step()
    assert h.meta.stores_done == Counter({1: 1}) and h.meta.stores_failed == Counter({2: 1})
    h.worker.make_fence = lambda: DONE
    _load(h, 3, "L", bl, sa)
    rpc("wake_up", kwargs={"tags": ["weights"]})  # verl wakes the weights first
    _load(h, 4, "M", bl, sa)
    h.step_until(lambda: {"L", "M"} <= set(h.recving))
    assert h.meta.loads_failed == Counter({"L": 1, "M": 1})  # the KV cache still asleep
    rpc("wake_up", kwargs={"tags": ["kv_cache"]})
    assert h.worker.kv_released is None
    _load(h, 5, "R", bl, sa)
    h.step_until(lambda: "R" in h.recving)
    assert h.pool_holds(bl, sa) and "R" not in h.meta.loads_failed

    # release_kv_cache_memory(): discard of the KV cache, back at wake_up
    rpc("discard", args=(("kv_cache",),))
    assert worker.calls[-1] == ("discard", ("kv_cache",), ("discard(kv_cache)", 0))
    rpc("wake_up", kwargs={"tags": ["kv_cache"]})
    assert h.worker.kv_released is None and weights.label == ""


def test_a_sleep_that_cannot_release_the_kv_memory_fails_before_it_frees_anything(
    harness, gen, checkpoints
):
    orig, _ = checkpoints
    h = harness()
    stuck = StuckNixl(h.worker, timeout_s=0.05)
    worker = SleepingWorker(Model(), orig, h.worker, h.lay, gen)
    rpc, weights = _uniproc(worker)
    ((b, s),) = split(gen, 1, 8)
    _stores(h, (1, "S", b, s))
    with pytest.raises(KVMemoryBusy, match="Nothing was released"):
        rpc("sleep", kwargs={"level": 2})
    assert worker.calls == [] and weights.label == ""  # vLLM's sleep never ran
    stuck.end()
    h.step_until(lambda: not h.worker._inflight)
    rpc("sleep", kwargs={"level": 1})
    assert worker.calls == [("sleep", 1, ("sleep(level=1)", 0))]


# ---- the weights' label at each level -------------------------------------------------


class KVCalls:
    """The KVBMWorker's release and restore, recorded."""

    def __init__(self):
        self.calls: list[tuple] = []

    def release_kv(self, why: str) -> None:
        self.calls.append(("release", why))

    def restore_kv(self) -> None:
        self.calls.append(("restore",))


def _engine(path, executor=_uniproc, model=Model):
    worker = SleepingWorker(model(), path, KVCalls())
    rpc, weights = executor(worker)
    return rpc, weights, worker


def test_level_1_keeps_the_label_level_2_takes_the_label_of_what_is_loaded_after(checkpoints):
    orig, new = checkpoints
    plain_rpc, plain, _ = _engine(orig)  # no sleep: the update alone
    plain_rpc("reload_weights", kwargs={"weights_path": new})
    updated = _reset(plain, 1)
    assert updated.startswith("load:")

    rpc, weights, worker = _engine(orig)
    rpc("sleep", kwargs={"level": 1})
    rpc("wake_up", kwargs={"tags": None})
    assert worker.calls == [
        ("sleep", 1, ("release", "sleep(level=1)")),
        ("wake_up", None, ("release", "sleep(level=1)")),
    ]
    assert worker.kv.calls[-1] == ("restore",)  # after vLLM's wake_up mapped it back
    assert weights.take_unreported() == [] and _reset(weights, 1) == ""  # pages made before hit

    rpc("sleep", kwargs={"level": 2})
    (e_now, _, now), (e_next, _, then) = weights.take_unreported()[-2:]
    assert (e_now, e_next) == (1, 2)  # at once, and for the next epoch
    assert now.startswith("private:") and then == now
    rpc("wake_up")
    assert not weights.serves((1, ("",)))  # the weights before are gone
    rpc("reload_weights", kwargs={"weights_path": new})  # identified, every parameter
    assert _reset(weights, 2) == updated  # as the engine that never slept
    # The startup checkpoint after a level-2 sleep: the files' label again.
    rpc("sleep", kwargs={"level": 2})
    rpc("wake_up")
    rpc("reload_weights", kwargs={"weights_path": orig})
    assert _reset(weights, 3) == ""


def _update(rpc, pairs) -> None:
    rpc("start_weight_update")
    for pair in pairs:
        rpc("update_weights", args=({"weights": [pair]},))
    rpc("finish_weight_update")


def test_after_level_2_a_partial_unidentified_or_missing_load_is_private(checkpoints, monkeypatch):
    from safetensors.torch import load_file

    orig, new = checkpoints
    pairs = list(load_file(f"{new}/model.safetensors").items())
    nccl = "vllm.distributed.weight_transfer.nccl_engine.NCCLWeightTransferEngine"
    module, name = nccl.rsplit(".", 1)

    def slept(executor=_uniproc, model=Model):
        rpc, weights, worker = _engine(orig, executor, model)
        worker.weight_transfer_engine = type(name, (), {"__module__": module})()
        rpc("sleep", kwargs={"level": 2})
        rpc("wake_up")
        return rpc, weights

    rpc, weights = slept()
    _update(rpc, pairs)  # every parameter: the update's label
    full = _reset(weights, 1)
    assert full.startswith("load:")
    rpc, weights = slept(_multiproc)
    _update(rpc, [p for p in pairs if p[0] != "norm.bias"])  # one left as sleep left it
    assert _reset(weights, 1).startswith("private:")
    rpc, weights = slept()
    rpc(_scale_norm)  # a function sent: nothing says what it loaded
    assert _reset(weights, 1).startswith("private:")
    rpc, weights = slept()
    assert _reset(weights, 1).startswith("private:")  # woken up with nothing loaded
    # A model whose load_weights does not say which parameters it loaded.
    rpc, weights = slept(model=QuietModel)
    _update(rpc, pairs)
    assert _reset(weights, 1).startswith("private:")
    # Parameters that cannot be listed at sleep: the sleep goes on, the label stays private.
    from vllm_kvbm.worker import sleep_mode

    def unlistable(worker):
        raise RuntimeError("no model runner")

    monkeypatch.setattr(sleep_mode, "_dropped_parameters", unlistable)
    rpc, weights = slept()
    _update(rpc, pairs)
    assert _reset(weights, 1).startswith("private:")


class QuietModel(Model):
    def load_weights(self, weights):
        super().load_weights(weights)  # returns None, as a model may


def test_sleep_preserve_parameter_names_need_no_load_and_discard_of_weights_is_level_2(checkpoints):
    from safetensors.torch import load_file

    orig, new = checkpoints
    pairs = [p for p in load_file(f"{new}/model.safetensors").items() if p[0] != "norm.bias"]
    rpc, weights, worker = _engine(orig)
    worker.vllm_config.model_config.sleep_preserve_parameter_names = ["norm.b*"]
    rpc("sleep", kwargs={"level": 2})
    rpc("wake_up")
    rpc("reload_weights", kwargs={"weights_iterator": iter(pairs)})  # all but the kept one
    assert _reset(weights, 1).startswith("load:")

    rpc, weights, worker = _engine(orig)
    rpc("discard", args=(("weights",),))
    assert worker.kv.calls == [] and weights.label.startswith("private:")
    rpc("wake_up", kwargs={"tags": ["weights"]})
    rpc("reload_weights", kwargs={"weights_iterator": iter(pairs)})  # norm.bias not loaded
    assert _reset(weights, 1).startswith("private:")


def test_sleep_stops_a_digest_pass_reading_the_weights_and_wake_up_runs_it_again(
    checkpoints, monkeypatch
):
    """A large model's digest pass runs on a thread: it must not read the
    parameters while vLLM frees their memory."""
    orig, _ = checkpoints
    monkeypatch.setattr(loaded_weights, "INLINE_DIGEST_BYTES", 0)
    digest, reading = loaded_weights.weights_digest, threading.Event()

    def endless(model, threads=None, stop=None):  # reads the weights until told to stop
        reading.set()
        while not stop.is_set():
            time.sleep(0.001)
        raise DigestStopped

    rpc, weights, worker = _engine(orig)
    monkeypatch.setattr(loaded_weights, "weights_digest", endless)
    assert not weights.serves((1, ("",)))  # its pass runs
    assert reading.wait(5)
    [(thread, _, _)] = [weights._pass]
    rpc("sleep", kwargs={"level": 1})
    assert not thread.is_alive() and worker.calls[0][0] == "sleep"
    assert not weights.serves((1, ("",))) and weights.take_unreported() == []
    monkeypatch.setattr(loaded_weights, "weights_digest", digest)
    rpc("wake_up", kwargs={"tags": ["kv_cache"]})
    assert weights._rerun == 1  # not yet: the weights are still asleep
    rpc("wake_up", kwargs={"tags": ["weights"]})
    deadline = time.monotonic() + 10
    while not (reports := weights.take_unreported()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert reports == [(1, 0, "")] and weights.serves((1, ("",)))
