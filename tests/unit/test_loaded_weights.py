"""The weights a worker runs, as labels (worker/loaded_weights.py), and the
scheduler's weights epochs (scheduler/weights_epochs.py): real torch modules,
no engine. The changes vLLM makes through collective_rpc are in
test_weight_changes.py."""

from __future__ import annotations

import threading

import torch

from vllm_kvbm.scheduler.weights_epochs import WeightsEpochs
from vllm_kvbm.worker.loaded_weights import LoadedWeights, weights_digest


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    model.register_buffer("rope", torch.arange(16, dtype=torch.float32))
    return model


def test_digest_follows_every_parameter_and_buffer():
    a, b = _model(), _model()
    assert weights_digest(a) == weights_digest(b)  # same weights, another copy
    with torch.no_grad():
        b[1].weight[3] += 1e-6
    assert weights_digest(a) != weights_digest(b)
    c = _model()
    c.rope[5] = -1
    assert weights_digest(a) != weights_digest(c)
    d = _model()
    d[0].weight.data = d[0].weight.data.to(torch.float64)  # same values, other bytes
    assert weights_digest(a) != weights_digest(d)


def _worker(model, rank: int = 0) -> LoadedWeights:
    weights = LoadedWeights(rank, lambda: model)
    weights.digest_at_load()
    return weights


def test_unchanged_weights_keep_the_files_label_across_epochs():
    worker = _worker(_model())
    assert worker.serves(None)  # nothing keyed yet
    assert worker.serves((0, ("",)))
    assert worker.serves((1, ("",))) and worker.take_unreported() == [(1, 0, "")]
    assert worker.serves((2, ("",)))


def test_parameters_changed_with_no_call_seen_get_a_private_label_for_good():
    """The digest of the parameters does not show all a model computes with
    (vLLM's CPU build runs linear layers from packed copies outside them), so
    a change no call showed is nobody else's: a private label, and weights
    back to their digest at load do not give the files' label back."""
    model = _model()
    worker = _worker(model)
    with torch.no_grad():
        model[1].weight.mul_(2)
    assert not worker.serves((1, ("",)))
    [(epoch, rank, label)] = worker.take_unreported()
    assert (epoch, rank) == (1, 0) and label.startswith("private:")
    assert worker.serves((1, (label,)))
    assert worker.serves((2, (label,)))  # no change since: the same label
    assert worker.take_unreported() == [(2, 0, label)]
    with torch.no_grad():
        model[1].weight.div_(2)  # back to the digest at load
    assert not worker.serves((3, (label,)))
    [(_, _, back)] = worker.take_unreported()
    assert back.startswith("private:") and back != label


def test_without_the_model_each_epoch_is_new():
    weights = LoadedWeights(0, None)
    assert weights.serves((0, ("",)))
    assert not weights.serves((1, ("",)))
    [(_, _, first)] = weights.take_unreported()
    weights.serves((2, (first,)))
    [(_, _, second)] = weights.take_unreported()
    assert first and second and first != second


def test_engines_that_received_the_same_update_agree_on_the_keys():
    base = b"\x01" * 32
    a, b = WeightsEpochs(2), WeightsEpochs(2)
    assert a.seed(base) == base  # as loaded: the namespace's seed
    for epochs in (a, b):
        epochs.new_epoch()
        assert not epochs.reported([(1, 0, "d0")])  # rank 1 not in yet
        assert not epochs.reported([(0, 1, "stale epoch")])
        assert epochs.reported([(1, 1, "d1")])
        assert epochs.meta() == (1, ("d0", "d1"))
    assert a.seed(base) == b.seed(base) != base
    a.new_epoch()
    assert not a.reported([(2, 0, "d0"), (2, 1, "d1")])  # the same weights: same keys
    a.meta()
    a.new_epoch()
    assert a.reported([(3, 0, ""), (3, 1, "")]) and a.seed(base) == base


def test_a_rank_that_changes_label_within_an_epoch_moves_the_keys_at_once():
    """A change without a reset: the worker reports its new label in the
    epoch it is in, and the keys follow without waiting for the other rank
    (that rank refuses the jobs until its own report is in)."""
    epochs = WeightsEpochs(2)
    assert not epochs.reported([(0, 0, "")])
    assert epochs.reported([(0, 1, "private:x")]) and epochs.labels == ("", "private:x")
    assert epochs.reported([(0, 0, "private:y")]) and epochs.labels == ("private:y", "private:x")


def test_a_second_reset_while_the_workers_digest_starts_another_epoch():
    """The first reset's epoch reached the workers (a step's metadata
    carried it) and a large model's digest runs on a thread; the weights
    change, and vLLM's cache is reset again: that reset is a new epoch, and
    the first digest's report, taken of weights since changed, names no keys."""
    epochs = WeightsEpochs(1)
    epochs.new_epoch()
    epochs.new_epoch()  # the same reset seen by both hooks: one epoch
    assert epochs.meta() == (1, ("",))  # a step carried it to the workers
    epochs.new_epoch()  # the second reset, before any report
    assert epochs.meta() == (2, ("",))
    assert not epochs.reported([(1, 0, "digest of the weights before")])
    assert epochs.labels == ("",)
    assert epochs.reported([(2, 0, "private:z")]) and epochs.labels == ("private:z",)


def test_the_model_is_found_from_vllms_caller_and_an_unreadable_one_is_a_new_epoch_each_reset():
    model = _model()

    class Runner:  # vLLM registers the KV cache from its model runner's methods
        def __init__(self, get_model):
            self.get_model = get_model

        def initialize_kv_cache(self):
            return LoadedWeights.from_vllm(0)

    class Executor:  # vLLM dispatches collective_rpc from its executor
        driver_worker = None

        def collective_rpc(self, method, *args):
            return method()

    found = Executor().collective_rpc(Runner(lambda: model).initialize_kv_cache)
    assert found.serves((0, ("",)))
    with torch.no_grad():
        model[0].weight.add_(1)
    assert not found.serves((1, ("",)))
    [(epoch, _, label)] = found.take_unreported()
    assert epoch == 1 and label.startswith("private:")

    def unreadable():
        raise RuntimeError("no model")

    fallback = Executor().collective_rpc(Runner(unreadable).initialize_kv_cache)
    assert fallback.serves((0, ("",))) and not fallback.serves((1, ("",)))


def test_an_engine_whose_calls_cannot_be_seen_keeps_its_pages_to_itself():
    """No collective_rpc dispatch on the stack (an executor KVBM cannot
    watch): a private label at once, and a new one at every epoch."""
    model = _model()

    class Runner:
        def get_model(self):
            return model

        def initialize_kv_cache(self):
            return LoadedWeights.from_vllm(0)

    blind = Runner().initialize_kv_cache()
    [(epoch, _, first)] = blind.take_unreported()
    assert epoch == 0 and first.startswith("private:") and not blind.serves((0, ("",)))
    assert blind.serves((0, (first,)))
    blind.serves((1, (first,)))
    [(epoch, _, second)] = blind.take_unreported()
    assert epoch == 1 and second.startswith("private:") and second != first


def test_a_large_models_pass_runs_off_the_worker_thread_its_jobs_refused_meanwhile(monkeypatch):
    from vllm_kvbm.worker import loaded_weights

    monkeypatch.setattr(loaded_weights, "INLINE_DIGEST_BYTES", 0)  # every model "large"
    release = threading.Event()
    digest = loaded_weights.weights_digest

    def slow_digest(model, threads=None, stop=None):
        release.wait()
        return digest(model, threads, stop)

    model = _model()
    worker = _worker(model)
    monkeypatch.setattr(loaded_weights, "weights_digest", slow_digest)
    assert not worker.serves((1, ("",)))  # returns while the pass waits
    assert not worker.serves((1, ("",))) and worker.take_unreported() == []
    release.set()
    while not (reports := worker.take_unreported()):
        release.wait(0.01)
    assert reports == [(1, 0, "")] and worker.serves((1, ("",)))


def test_a_pass_overtaken_by_the_next_epoch_reports_nothing(monkeypatch):
    """The worker side of a second reset during a threaded digest: the first
    pass's result is dropped, the second epoch's pass reports."""
    from vllm_kvbm.worker import loaded_weights

    monkeypatch.setattr(loaded_weights, "INLINE_DIGEST_BYTES", 0)
    first, digest = threading.Event(), loaded_weights.weights_digest
    calls = []

    def digest_once_slow(model, threads=None, stop=None):
        calls.append(1)
        if len(calls) == 2:  # the first epoch's pass (the first call is at load)
            first.wait()
        return digest(model, threads, stop)

    monkeypatch.setattr(loaded_weights, "weights_digest", digest_once_slow)
    model = _model()
    worker = _worker(model)
    assert not worker.serves((1, ("",)))
    while len(calls) < 2:  # the first pass is in its digest (its thread started first)
        threading.Event().wait(0.01)
    worker.serves((2, ("",)))  # the next epoch while the first pass runs
    while not (reports := worker.take_unreported()):
        threading.Event().wait(0.01)
    first.set()
    threading.Event().wait(0.05)
    assert reports + worker.take_unreported() == [(2, 0, "")]


def test_epochs_are_settled_once_every_rank_reported_and_none_announced_a_change():
    """What the scheduler asks before it offers a load as synchronous
    (layered): a worker would refuse one keyed under weights in doubt."""
    w = WeightsEpochs(2)
    assert w.settled  # as loaded
    w.meta()
    w.new_epoch()  # a reset: both ranks label their weights again
    assert not w.settled
    w.reported([(w.epoch, 0, "")])
    assert not w.settled
    w.reported([(w.epoch, 1, "")])
    assert w.settled
    w.reported([(w.epoch + 1, 0, "update:ab")])  # a change, for the next epoch
    assert not w.settled
