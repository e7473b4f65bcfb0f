"""The calls vLLM runs on a worker, seen where it dispatches them
(worker/weight_changes.py), and the labels they give the weights
(worker/loaded_weights.py). vLLM's own dispatch code runs them (the
multiprocessing executor's ``WorkerProc._execute_worker_rpc``, the
single-process executor's ``collective_rpc``) and its ``DefaultModelLoader``
reads the weight files; the worker and its model are small stand-ins."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vllm_kvbm import opened_files
from vllm_kvbm.worker.loaded_weights import LoadedWeights
from vllm_kvbm.worker.read_only_rpcs import LOADING_TRANSFER_ENGINES
from vllm_kvbm.worker.weight_digests import LoadDigest


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)

    def load_weights(self, weights):  # as vLLM's models: (name, tensor) pairs
        params = dict(self.named_parameters())
        loaded = set()
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)
                loaded.add(name)
        return loaded


def _checkpoint(directory: Path, model: Model, scale: float = 1.0) -> str:
    from safetensors.torch import save_file

    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file(
        {k: v.detach() * scale for k, v in model.state_dict().items()},
        str(directory / "model.safetensors"),
    )
    return str(directory)


def _files(path: str):
    """vLLM's loader reading a checkpoint (it records the files it picks)."""
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    loader = DefaultModelLoader(LoadConfig(load_format="safetensors"))
    return loader._get_weights_iterator(DefaultModelLoader.Source(path, None))


class Runner:
    def __init__(self, model):
        self.model = model

    def get_model(self):
        return self.model

    def initialize_kv_cache(self):
        self.weights = LoadedWeights.from_vllm(0)


class Worker:
    """vLLM's worker methods this test calls, as vLLM's gpu_worker has them."""

    def __init__(self, model, path):
        self.model_runner = Runner(model)
        self.rank = 0
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(model=path))
        self.weight_transfer_engine = None
        self.model_runner.get_model().load_weights(_files(path))  # vLLM's load

    def register_kv_cache(self):  # vLLM: initialize_from_config -> the connector
        self.model_runner.initialize_kv_cache()

    def execute_model(self, scheduler_output=None):
        return "stepped"

    def reload_weights(self, weights_iterator=None, weights_path=None):
        path = weights_path or self.vllm_config.model_config.model
        self.model_runner.get_model().load_weights(weights_iterator or _files(path))

    def start_weight_update(self):
        pass

    def update_weights(self, update_info):
        self.model_runner.get_model().load_weights(update_info["weights"])

    def finish_weight_update(self):
        pass


@pytest.fixture
def checkpoints(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBM_CACHE_DIR", str(tmp_path / "cache"))
    opened_files.install()
    opened_files.reset()
    model = Model()
    yield (_checkpoint(tmp_path / "orig", model), _checkpoint(tmp_path / "new", model, 2.0))
    opened_files.reset()


def _uniproc(worker):
    """vLLM's single-process executor around ``worker``, the KV cache registered."""
    from vllm.v1.executor.uniproc_executor import UniProcExecutor
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    executor = object.__new__(UniProcExecutor)
    executor.driver_worker = WorkerWrapperBase(rpc_rank=0)
    executor.driver_worker.worker = worker
    executor.driver_worker.mm_receiver_cache = None
    executor.collective_rpc("register_kv_cache")
    return executor.collective_rpc, worker.model_runner.weights


def _multiproc(worker):
    """vLLM's worker process loop's dispatch around ``worker``."""
    from vllm.v1.executor.multiproc_executor import WorkerProc
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    proc = object.__new__(WorkerProc)
    proc.worker = WorkerWrapperBase(rpc_rank=0)
    proc.worker.worker = worker
    proc.worker.mm_receiver_cache = None
    proc.rank, outputs = 0, []
    proc.handle_output = outputs.append

    def rpc(method, args=(), kwargs=None):
        if callable(method):
            import cloudpickle

            method = cloudpickle.dumps(method)
        proc._execute_worker_rpc((method, args, kwargs or {}, 0))
        if isinstance(outputs[-1], Exception):
            raise outputs[-1]
        return [outputs[-1]]

    rpc("register_kv_cache")
    return rpc, worker.model_runner.weights


def _reset(weights, epoch: int) -> str:
    """A prefix-cache reset reaches the worker: the label it reports."""
    weights.serves((epoch, ("?",)))
    return weights.take_unreported()[-1][2]


def _scale_norm(worker):
    worker.model_runner.get_model().norm.weight.data.mul_(3)


@pytest.mark.parametrize("executor", [_uniproc, _multiproc], ids=["uniproc", "multiproc"])
def test_steps_keep_the_label_and_a_function_sent_moves_it_at_once(checkpoints, executor):
    orig, _ = checkpoints
    rpc, weights = executor(Worker(Model(), orig))
    assert rpc("execute_model", args=(None,)) == ["stepped"]
    assert weights.label == "" and weights.take_unreported() == []
    rpc(_scale_norm)  # as an RL loop's weight sync, no reset after
    [(now, _, moved), (then, _, earned)] = weights.take_unreported()
    assert (now, then) == (0, 1) and moved.startswith("private:")
    assert not weights.serves((0, ("",))) and weights.serves((0, (moved,)))
    # The reset: a new private label (pages made before it may hold KV of
    # vLLM's cache from the weights before), announced for it beforehand and
    # kept while nothing changes.
    after = _reset(weights, 1)
    assert after == earned and after.startswith("private:") and after != moved
    assert _reset(weights, 2) == after
    with pytest.raises(Exception):
        rpc("no_such_method")  # an unknown method counts as a change too
    assert _reset(weights, 3) not in (after, "")


def test_a_reload_is_labelled_by_what_it_loaded_and_the_files_come_back(checkpoints):
    orig, new = checkpoints
    rpc, weights = _uniproc(Worker(Model(), orig))
    rpc("reload_weights", kwargs={"weights_path": new})
    [(now, _, during), (then, _, earned)] = weights.take_unreported()
    assert (now, then) == (0, 1) and during.startswith("private:")  # until the reset
    loaded = _reset(weights, 1)
    assert loaded == earned and loaded.startswith("load:")
    # Another engine that received the same reload agrees; from an iterator
    # of the same tensors too (the pairs are what count, not the files).
    rpc2, other = _uniproc(Worker(Model(), orig))
    rpc2("reload_weights", kwargs={"weights_path": new})
    assert _reset(other, 1) == loaded
    from safetensors.torch import load_file

    rpc3, third = _uniproc(Worker(Model(), orig))
    pairs = list(load_file(f"{new}/model.safetensors").items())
    rpc3("reload_weights", kwargs={"weights_iterator": iter(pairs[::-1])})
    assert _reset(third, 1) == loaded
    # The checkpoint loaded at startup again: the files' label.
    rpc("reload_weights", kwargs={"weights_path": orig})
    assert _reset(weights, 2) == ""
    # After a change KVBM cannot identify, never again (until a restart).
    rpc(_scale_norm)
    rpc("reload_weights", kwargs={"weights_path": orig})
    assert _reset(weights, 3).startswith("load:")


def test_a_reload_that_fails_is_a_change_kvbm_cannot_identify(checkpoints, tmp_path):
    orig, _ = checkpoints
    rpc, weights = _uniproc(Worker(Model(), orig))
    with pytest.raises(Exception):
        rpc("reload_weights", kwargs={"weights_path": str(tmp_path / "missing")})
    assert _reset(weights, 1).startswith("private:")


def test_a_weight_transfer_update_is_labelled_by_its_chunks(checkpoints, monkeypatch):
    orig, _ = checkpoints
    from safetensors.torch import load_file

    pairs = [(k, v * 2) for k, v in load_file(f"{orig}/model.safetensors").items()]
    labels = []
    nccl = "vllm.distributed.weight_transfer.nccl_engine.NCCLWeightTransferEngine"
    assert nccl in LOADING_TRANSFER_ENGINES
    # (vLLM 0.34's use_load_plan loads planned updates past load_weights)
    for engine, plan in [(nccl, None), ("a.DirectCopyEngine", None), (nccl, ["a plan"])]:
        worker = Worker(Model(), orig)
        module, name = engine.rsplit(".", 1)
        worker.weight_transfer_engine = type(
            name, (), {"__module__": module, "_plan_metadata": plan}
        )()
        rpc, weights = _multiproc(worker)
        rpc("start_weight_update")
        for pair in pairs:  # one chunk per tensor
            rpc("update_weights", args=({"weights": [pair]},))
        rpc("execute_model", args=(None,))  # a step mid-update: the label is private meanwhile
        assert weights.label.startswith("private:")
        rpc("finish_weight_update")
        labels.append(_reset(weights, 1))
    assert labels[0].startswith("load:")
    assert labels[1].startswith("private:") and labels[2].startswith("private:")
    # the same tensors reloaded: the same label as the update's
    rpc, weights = _uniproc(Worker(Model(), orig))
    rpc("reload_weights", kwargs={"weights_iterator": iter(pairs)})
    assert _reset(weights, 1) == labels[0]


def test_a_load_digest_is_of_the_pairs_in_any_order_of_names():
    a, b, c = LoadDigest(), LoadDigest(), LoadDigest()
    x, y = torch.ones(3), torch.zeros(2)
    list(a.passing(iter([("x", x), ("y", y)])))
    b.passing([("y", y), ("x", x)])
    list(c.passing(iter([("x", x), ("y", y * 1.0 + 1e-7)])))
    assert a.hexdigest() == b.hexdigest() != c.hexdigest()
    assert a.names == {"x", "y"} and not LoadDigest()
