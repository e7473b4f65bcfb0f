"""The weights a worker runs, digested from its parameters and buffers
(worker/loaded_weights.py), and the scheduler's weights epochs
(scheduler/weights_epochs.py): real torch modules, no engine."""

from __future__ import annotations

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


def test_a_worker_serves_only_jobs_keyed_under_its_weights():
    model = _model()
    worker = _worker(model)
    assert worker.serves((0, ("",)))
    assert worker.serves(None)  # nothing keyed yet
    with torch.no_grad():
        model[1].weight.mul_(2)
    # Before a new epoch the worker cannot know (vLLM's cache is stale too);
    # the epoch the next reset starts digests again.
    assert not worker.serves((1, ("",)))
    [(epoch, rank, label)] = worker.take_unreported()
    assert (epoch, rank) == (1, 0) and label == weights_digest(model)
    assert worker.serves((1, (label,)))
    assert worker.take_unreported() == []
    with torch.no_grad():
        model[1].weight.div_(2)  # back to the weights as loaded
    assert not worker.serves((2, (label,)))
    assert worker.take_unreported() == [(2, 0, "")]
    assert worker.serves((2, ("",)))


def test_a_weight_change_vllm_makes_refuses_jobs_until_the_next_epoch():
    class FakeVllmWorker:
        def reload_weights(self):
            with torch.no_grad():
                model[0].bias.add_(1)

    model = _model()
    weights = _worker(model)
    vllm_worker = FakeVllmWorker()
    weights.observe_changes(vllm_worker)
    vllm_worker.reload_weights()
    assert not weights.serves((0, ("",)))
    assert not weights.serves((1, ("",)))
    [(_, _, label)] = weights.take_unreported()
    assert weights.serves((1, (label,)))


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
    a.new_epoch()
    assert a.reported([(3, 0, ""), (3, 1, "")]) and a.seed(base) == base


def test_the_model_is_found_from_vllms_caller_and_an_unreadable_one_is_a_new_epoch_each_reset():
    model = _model()

    class Runner:  # vLLM registers the KV cache from its model runner's methods
        def __init__(self, get_model):
            self.get_model = get_model

        def initialize_kv_cache(self):
            return LoadedWeights.from_vllm(0)

    found = Runner(lambda: model).initialize_kv_cache()
    with torch.no_grad():
        model[0].weight.add_(1)
    assert not found.serves((1, ("",)))
    assert found.take_unreported() == [(1, 0, weights_digest(model))]

    def unreadable():
        raise RuntimeError("no model")
    fallback = Runner(unreadable).initialize_kv_cache()
    assert fallback.serves((0, ("",))) and not fallback.serves((1, ("",)))


def test_a_large_models_pass_runs_off_the_worker_thread_its_jobs_refused_meanwhile(monkeypatch):
    import threading

    from vllm_kvbm.worker import loaded_weights

    monkeypatch.setattr(loaded_weights, "INLINE_DIGEST_BYTES", 0)  # every model "large"
    release = threading.Event()
    digest = loaded_weights.weights_digest

    def slow_digest(model, threads=None):
        release.wait()
        return digest(model, threads)

    model = _model()
    worker = _worker(model)
    monkeypatch.setattr(loaded_weights, "weights_digest", slow_digest)
    assert not worker.serves((1, ("",)))  # returns while the pass waits
    assert not worker.serves((1, ("",))) and worker.take_unreported() == []
    release.set()
    while not (reports := worker.take_unreported()):
        release.wait(0.01)
    assert reports == [(1, 0, "")] and worker.serves((1, ("",)))
