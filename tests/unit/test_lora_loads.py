"""The LoRA weights vLLM loaded, as the workers see them (worker/lora_loads.py),
and what the scheduler does with their reports (scheduler/lora_adapters.py).

vLLM reads an adapter's files when it loads it, which may be before or after
the scheduler fingerprints them for a request's keys; a job whose keys name
other weights than a worker loaded is refused, and the scheduler stops caching
the adapter once it hears of the load."""

from __future__ import annotations

import logging

import pytest

from vllm_kvbm.fingerprints import adapter_fingerprint, adapter_stat, clear_memory_cache
from vllm_kvbm.worker import lora_loads


@pytest.fixture(autouse=True)
def own_registry(monkeypatch, tmp_path):
    monkeypatch.setattr(lora_loads, "_loaded", {})
    monkeypatch.setattr(lora_loads, "_unreported", [])
    monkeypatch.setenv("KVBM_CACHE_DIR", str(tmp_path / "kvbm-cache"))
    clear_memory_cache()
    yield
    clear_memory_cache()


def make_adapter(path, weights: bytes) -> str:
    path.mkdir(exist_ok=True)
    (path / "adapter_config.json").write_text('{"r": 8}')
    (path / "adapter_model.safetensors").write_bytes(weights)
    return str(path)


def test_watch_wraps_vllms_adapter_loader_once(monkeypatch):
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager, WorkerLoRAManager

    original = WorkerLoRAManager._load_adapter
    monkeypatch.setattr(WorkerLoRAManager, "_load_adapter", original)  # restored after
    monkeypatch.setattr(lora_loads, "_watching", False)
    assert lora_loads.watch() and lora_loads.watch()
    wrapped = WorkerLoRAManager._load_adapter
    assert getattr(wrapped, "__kvbm_observed__", False) and wrapped.__wrapped__ is original
    assert LRUCacheWorkerLoRAManager._load_adapter is wrapped  # what vLLM's runner uses


def test_a_job_naming_other_weights_than_loaded_is_refused(tmp_path):
    path = make_adapter(tmp_path / "a", b"loaded weights")
    loaded = lora_loads.loaded(1, path, adapter_stat(path))
    assert loaded == adapter_fingerprint(path)
    assert not lora_loads.refuses((1, loaded))
    assert lora_loads.refuses((1, "the files' fingerprint since"))
    assert not lora_loads.refuses((2, "never loaded here"))
    assert not lora_loads.refuses(None)
    assert lora_loads.take_unreported() == [(1, loaded)]
    assert lora_loads.take_unreported() == []


def test_a_reload_of_other_weights_refuses_both(tmp_path):
    path = make_adapter(tmp_path / "a", b"first weights")
    first = lora_loads.loaded(1, path, adapter_stat(path))
    make_adapter(tmp_path / "a", b"second weights")
    second = lora_loads.loaded(1, path, adapter_stat(path))
    assert first != second
    assert lora_loads.refuses((1, first)) and lora_loads.refuses((1, second))


def test_files_rewritten_while_vllm_reads_them_match_no_keys(tmp_path):
    """The write lands between vLLM's read and the fingerprint: what vLLM
    read is unknown, so every job of the adapter is refused."""
    path = make_adapter(tmp_path / "a", b"read by vLLM")

    def load_during_a_rewrite(manager, request):
        make_adapter(tmp_path / "a", b"written meanwhile, longer")
        return "model"

    class Request:
        lora_int_id, lora_path = 3, path

    load = lora_loads._observed(load_during_a_rewrite)
    assert load(None, Request()) == "model"
    assert lora_loads.take_unreported() == [(3, lora_loads.CHANGED_WHILE_LOADING)]
    assert lora_loads.refuses((3, adapter_fingerprint(path)))


def test_scheduler_stops_caching_an_adapter_loaded_with_other_weights(tmp_path, caplog):
    """Loaded (say by /v1/load_lora_adapter), then rewritten before its first
    request: the request's keys would name the new files, vLLM runs the old
    weights. Once a worker reports the load, no lookup, no store."""
    from vllm.lora.request import LoRARequest
    from vllm.v1.outputs import KVConnectorOutput

    from helpers.scheduler_harness import fingerprinted, kvbm, make_request, make_scheduler, tokens
    from vllm_kvbm.messages import KVBMWorkerMetadata

    path = make_adapter(tmp_path / "a", b"old weights")
    old = adapter_fingerprint(path)
    k = kvbm(make_scheduler(host_blocks=16))
    prompt = tokens(3 * 128 + 5, 93)
    same = make_request(prompt, lora_request=LoRARequest("tuned", 1, path))
    fingerprinted(k, same.lora_request)
    k.get_num_new_matched_tokens(same, 0)
    k.update_connector_output(
        KVConnectorOutput(
            kv_connector_worker_meta=KVBMWorkerMetadata(adapters_loaded=[(1, old), (1, old)])
        )
    )
    assert not k._reqs[same.request_id].no_store  # TP ranks loading the same weights

    make_adapter(tmp_path / "b", b"old weights")
    other = make_request(prompt, lora_request=LoRARequest("other", 2, str(tmp_path / "b")))
    fingerprinted(k, other.lora_request)
    k.get_num_new_matched_tokens(other, 0)
    make_adapter(tmp_path / "b", b"new weights")
    with caplog.at_level(logging.WARNING, logger="vllm_kvbm.scheduler.lora_adapters"):
        k.update_connector_output(
            KVConnectorOutput(
                kv_connector_worker_meta=KVBMWorkerMetadata(
                    adapters_loaded=[(2, adapter_fingerprint(str(tmp_path / "b")))]
                )
            )
        )
    assert k._reqs[other.request_id].no_store
    assert "changed on disk" in caplog.text
    again = make_request(prompt, lora_request=LoRARequest("other", 2, str(tmp_path / "b")))
    assert k.get_num_new_matched_tokens(again, 0) == (0, False)
    assert again.request_id not in k._reqs

    # Reported before the adapter's first request: that request is not cached.
    k.update_connector_output(
        KVConnectorOutput(
            kv_connector_worker_meta=KVBMWorkerMetadata(adapters_loaded=[(4, "weights read then")])
        )
    )
    make_adapter(tmp_path / "c", b"weights now")
    late = make_request(prompt, lora_request=LoRARequest("late", 4, str(tmp_path / "c")))
    fingerprinted(k, late.lora_request)
    assert k.get_num_new_matched_tokens(late, 0) == (0, False)
    assert late.request_id not in k._reqs


def test_an_adapter_downloaded_at_its_first_load_is_cached_from_then_on(tmp_path):
    """A path with no local files when the first request arrives (an HF id
    vLLM downloads as it loads the adapter) is keyed without a fingerprint;
    the workers refuse that request's jobs (they loaded real files), and from
    the next request on the adapter is keyed and cached by those files."""
    from vllm.lora.request import LoRARequest
    from vllm.v1.outputs import KVConnectorOutput

    from helpers.scheduler_harness import fingerprinted, kvbm, make_request, make_scheduler, tokens
    from vllm_kvbm.messages import KVBMWorkerMetadata

    path = str(tmp_path / "not-yet-downloaded")
    k = kvbm(make_scheduler(host_blocks=16))
    prompt = tokens(3 * 128 + 5, 95)
    first = make_request(prompt, lora_request=LoRARequest("hub", 7, path))
    fingerprinted(k, first.lora_request)
    k.get_num_new_matched_tokens(first, 0)
    assert k._reqs[first.request_id].adapter == (7, "")
    assert lora_loads.refuses((7, "")) is False  # not loaded yet
    # vLLM's load downloads the files, then reads them: no files before it
    make_adapter(tmp_path / "not-yet-downloaded", b"downloaded weights")
    assert lora_loads.loaded(7, path, None) == adapter_fingerprint(path)
    assert lora_loads.refuses((7, ""))
    k.update_connector_output(
        KVConnectorOutput(
            kv_connector_worker_meta=KVBMWorkerMetadata(
                adapters_loaded=[(7, adapter_fingerprint(path))]
            )
        )
    )
    assert k._reqs[first.request_id].no_store

    second = make_request(prompt, lora_request=LoRARequest("hub", 7, path))
    fingerprinted(k, second.lora_request)
    k.get_num_new_matched_tokens(second, 0)
    state = k._reqs[second.request_id]
    assert state.adapter == (7, adapter_fingerprint(path)) and not state.no_store
    assert not lora_loads.refuses(state.adapter)
