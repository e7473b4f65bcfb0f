"""Drives vLLM's real scheduler with KVBMConnector, without a model or worker.

Adapted from vLLM's tests/v1/kv_connector/unit/utils.py to vLLM 0.32. The
"worker" is the test itself: it reads the connector metadata each step and
reports completions back through a KVConnectorOutput.

Also used by benchmarks/bench_scheduler.py (which puts tests/ on sys.path):
``make_scheduler`` takes the sizes of a GPU-like configuration, and
``worker_output`` builds one step's fake worker output apart from the
scheduler calls, so those can be timed on their own.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import json
import shutil
import tempfile
import time

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from vllm_kvbm.messages import KVBMConnectorMetadata, KVBMWorkerMetadata

BLOCK = 16
EOS = 2
_ids = itertools.count(1)
init_none_hash(sha256)


@functools.cache
def _model_dir(max_positions: int = 4096) -> str:
    """A Llama the scheduler can key: its shape, and a stand-in weights file
    (keys name the weights by their files' bytes; with none, an engine's
    pages are its own)."""
    path = tempfile.mkdtemp(prefix="kvbm-sched-model-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    config = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        num_hidden_layers=2,
        vocab_size=100_000,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        torch_dtype="float16",
        bos_token_id=1,
        eos_token_id=EOS,
    )
    with open(f"{path}/config.json", "w") as f:
        json.dump(config, f)
    with open(f"{path}/model.safetensors", "wb") as f:
        f.write(b"stand-in weights")
    return path


def make_scheduler(
    host_blocks: int = 64,
    num_blocks: int = 1000,
    max_batched: int = 256,
    num_layers: int = 2,
    load_failure_policy: str = "recompute",
    *,
    max_model_len: int = 4096,
    max_num_seqs: int = 16,
    tensor_parallel_size: int = 1,
    hash_algo: str = "sha256",
    model: str | None = None,
    kv_events: dict | None = None,
    **extra_config,
) -> Scheduler:
    """``model``: a model directory (default: a config-only Llama in a fresh
    temporary directory, which is part of the keys' namespace). ``kv_events``:
    vLLM's --kv-events-config (the scheduler then publishes KV events)."""
    model_config = ModelConfig(
        model=model or _model_dir(max(4096, max_model_len)),
        dtype="float16",
        seed=0,
        max_model_len=max_model_len,
        skip_tokenizer_init=True,
    )
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_batched,
            max_model_len=max_model_len,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(
            block_size=BLOCK, enable_prefix_caching=True, prefix_caching_hash_algo=hash_algo
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVBMConnector",
            kv_connector_module_path="vllm_kvbm.connector",
            kv_role="kv_both",
            kv_load_failure_policy=load_failure_policy,
            # No model runs here, so step times say nothing of what a load
            # or a recompute costs: the load/recompute split is off unless
            # a test turns it on.
            # A page per block unless a test asks for pages (test_pages.py;
            # page_tokens=None: the connector's default): the unit tests
            # count blocks.
            kv_connector_extra_config={
                k: v
                for k, v in {
                    "host_cache_blocks": host_blocks,
                    "load_split": False,
                    "page_tokens": BLOCK,
                    **extra_config,
                }.items()
                if v is not None
            },
        ),
        device_config=DeviceConfig("cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
        kv_events_config=KVEventsConfig(**kv_events) if kv_events else None,
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                [f"layer.{i}" for i in range(num_layers)],
                FullAttentionSpec(
                    block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float16
                ),
            )
        ],
    )
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK,
        log_stats=True,
    )


_SHA256_HASHER = get_request_block_hasher(BLOCK, sha256)


def make_request(
    tokens: list[int] | None, max_tokens: int = 4, *, block_hasher=_SHA256_HASHER, **fields
) -> Request:
    """A request as vLLM's engine core makes one: its block hashes computed
    by ``block_hasher`` (vLLM's default sha256 at BLOCK tokens; None: none).
    ``fields`` go to Request (lora_request, cache_salt, mm_features,
    prompt_embeds with ``tokens`` None, ...)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    params.update_from_generation_config({}, EOS)
    fields.setdefault("mm_features", None)
    return Request(
        request_id=f"r{next(_ids)}",
        prompt_token_ids=None if tokens is None else list(tokens),
        sampling_params=params,
        pooling_params=None,
        block_hasher=block_hasher,
        **fields,
    )


def kvbm(scheduler: Scheduler):
    """The connector's KVBMScheduler."""
    return scheduler.connector.sched


def step(
    scheduler: Scheduler,
    *,
    stores_done=(),
    stores_failed=(),
    loads_failed=(),
    spills_done=(),
    slots_held=(),
    slots_released=(),
    finished_recving=(),
    finished_sending=(),
    invalid_block_ids=(),
    failed_recving=(),
    loads_done=(),
    layered_workers: int = 0,
    layered_read_workers: int = 0,
    layered_peer_workers: int = 0,
    complete: bool = False,
    token: int = 7,
):
    """One engine step: schedule, then report what the fake worker finished.

    ``complete`` also reports everything this step's metadata asked for as
    finished in the same output (a worker whose copies finish within the step).

    Returns (scheduler_output, connector metadata, engine outputs).
    """
    out = scheduler.schedule()
    mro = worker_output(
        scheduler,
        out,
        stores_done=stores_done,
        stores_failed=stores_failed,
        loads_failed=loads_failed,
        spills_done=spills_done,
        slots_held=slots_held,
        slots_released=slots_released,
        finished_recving=finished_recving,
        finished_sending=finished_sending,
        invalid_block_ids=invalid_block_ids,
        failed_recving=failed_recving,
        loads_done=loads_done,
        layered_workers=layered_workers,
        layered_read_workers=layered_read_workers,
        layered_peer_workers=layered_peer_workers,
        complete=complete,
        token=token,
    )
    engine_outputs = scheduler.update_from_output(out, mro)
    return out, out.kv_connector_metadata, engine_outputs


def admit(scheduler: Scheduler, req: Request, timeout: float = 10.0, **report):
    """Steps until vLLM admits ``req``: with a disk or remote tier its lookup
    is answered by the connector's background thread, so vLLM asks again
    each step until the answer is there. ``report`` goes to every step.
    Returns the admitting step's (scheduler_output, metadata, engine outputs)."""
    import time

    from vllm.v1.request import RequestStatus

    deadline = time.monotonic() + timeout
    while True:
        result = step(scheduler, **report)
        if req.status != RequestStatus.WAITING:
            return result
        assert time.monotonic() < deadline, f"{req.request_id} was never admitted"
        time.sleep(0.005)


def lookup(connector_scheduler, req: Request, timeout: float = 10.0):
    """``get_num_new_matched_tokens(req, 0)`` once it has an answer (the
    lower tiers answer on a background thread; None means "ask again")."""
    import time

    deadline = time.monotonic() + timeout
    while (result := connector_scheduler.get_num_new_matched_tokens(req, 0))[0] is None:
        assert time.monotonic() < deadline, f"no lookup answer for {req.request_id}"
        time.sleep(0.005)
    return result


def worker_output(
    scheduler: Scheduler,
    out,
    *,
    stores_done=(),
    stores_failed=(),
    loads_failed=(),
    spills_done=(),
    slots_held=(),
    slots_released=(),
    finished_recving=(),
    finished_sending=(),
    invalid_block_ids=(),
    failed_recving=(),
    loads_done=(),
    layered_workers: int = 0,
    layered_read_workers: int = 0,
    layered_peer_workers: int = 0,
    complete: bool = False,
    token: int = 7,
) -> ModelRunnerOutput:
    """What the fake worker reports for scheduler output ``out`` (see ``step``)."""
    meta = out.kv_connector_metadata
    assert isinstance(meta, KVBMConnectorMetadata)
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        req = scheduler.requests[rid]
        # Partial prefill chunks sample nothing.
        sampled.append([token] if req.num_computed_tokens >= req.num_tokens else [])
    worker_meta = KVBMWorkerMetadata()
    if complete:
        stores_done = [*stores_done, *(job.job_id for job in meta.stores)]
        # a layered load is synchronous to vLLM: done in its step, not "received"
        finished_recving = [
            *finished_recving,
            *(job.req_id for job in meta.loads if not job.layered),
        ]
        loads_done = [*loads_done, *(job.req_id for job in meta.loads if job.layered)]
        finished_sending = [*finished_sending, *meta.delayed_free_req_ids]
    for job_id in stores_done:
        worker_meta.stores_done[job_id] += 1
    for job_id in stores_failed:
        worker_meta.stores_failed[job_id] += 1
    for rid in loads_failed:
        worker_meta.loads_failed[rid] += 1
    for rid in loads_done:
        worker_meta.loads_done[rid] += 1
    worker_meta.layered_workers = layered_workers
    worker_meta.layered_read_workers = layered_read_workers
    worker_meta.layered_peer_workers = layered_peer_workers
    for job_id in spills_done:
        worker_meta.spills_done[job_id] += 1
    worker_meta.slots_held.update(slots_held)
    worker_meta.slots_released.update(slots_released)
    if slots_held:
        worker_meta.transfer_timeouts["overdue"] = 1
    kv_out = KVConnectorOutput(
        finished_sending=set(finished_sending),
        finished_recving=set(finished_recving),
        invalid_block_ids=set(invalid_block_ids),
        failed_recving=set(failed_recving),
        kv_connector_worker_meta=worker_meta,
    )
    extra = {}
    if "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__:  # vLLM < 0.34
        extra["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    mro = ModelRunnerOutput(
        req_ids=req_ids,
        **extra,
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=kv_out,
    )
    return mro


def worker_weights(model: torch.nn.Module, rank: int = 0):
    """A worker's ``LoadedWeights`` for ``model``, digested as at load."""
    from vllm_kvbm.worker.loaded_weights import LoadedWeights

    weights = LoadedWeights(rank, lambda: model)
    weights.digest_at_load()
    return weights


def step_with_weights(scheduler: Scheduler, workers, **report):
    """One step whose workers are real ``LoadedWeights`` (one per TP rank):
    each judges the step's jobs as a worker does (digesting its model when
    the metadata starts a weights epoch) and reports its digest in the
    step's output. Returns (scheduler_output, metadata, whether each worker
    serves the step's jobs)."""
    out = scheduler.schedule()
    meta = out.kv_connector_metadata
    served = [worker.serves(meta.weights) for worker in workers]
    mro = worker_output(scheduler, out, **report)
    mro.kv_connector_output.kv_connector_worker_meta.weights_digested = [
        digest for worker in workers for digest in worker.take_unreported()
    ]
    scheduler.update_from_output(out, mro)
    return out, meta, served


def block_ids(scheduler: Scheduler, req_id: str) -> list[int]:
    return list(scheduler.kv_cache_manager.get_block_ids(req_id)[0])


# ---- driving requests through the scheduler ------------------------------------


def tokens(n: int, base: int) -> list[int]:
    """n distinct-looking token ids; different bases never share a block."""
    return [base * 1000 + i for i in range(n)]


def keys_of(sched, toks: list[int]) -> list[bytes]:
    """The keys the connector files ``toks``' full blocks under (a request
    without LoRA or cache salt; from vLLM's block hashes, as the harness
    hashes with sha256)."""
    return list(kvbm(sched).key_chain(make_request(toks)).extend(toks))


def run_until_done(sched, req_id: str, max_steps: int = 50) -> None:
    for _ in range(max_steps):
        if req_id not in sched.requests or sched.requests[req_id].is_finished():
            return
        step(sched)
    raise AssertionError(f"{req_id} did not finish")


def store_and_finish(sched, toks: list[int], max_tokens: int = 2):
    """Runs a request to completion with a worker that finishes every transfer
    within the step; returns the request and each step's metadata."""
    req = make_request(toks, max_tokens=max_tokens)
    return req, run_to_end(sched, req)


def run_to_end(sched, req) -> list:
    """Adds ``req`` and runs it to its end with a worker that finishes every
    transfer within the step; returns each step's metadata."""
    sched.add_request(req)
    metas = []
    steps, deadline = 0, time.monotonic() + 30
    while steps < 50 and time.monotonic() < deadline:
        if req.request_id not in sched.requests:
            return metas
        out, meta, _ = step(sched, complete=True)
        metas.append(meta)
        if out.num_scheduled_tokens:
            steps += 1
        else:  # its lookup is answered in the background (a tier behind a server)
            time.sleep(0.005)
    raise AssertionError(f"{req.request_id} did not finish")


def load_again(sched, toks: list[int], max_tokens: int = 2):
    """Stores ``toks`` through a finished request, clears vLLM's prefix cache
    and submits the same prompt: its first step plans one host-tier load.
    Returns (request, load job)."""
    store_and_finish(sched, toks)
    assert sched.reset_prefix_cache()
    req = make_request(toks, max_tokens=max_tokens)
    sched.add_request(req)
    _, meta, _ = step(sched)
    (load,) = meta.loads
    return req, load


def fingerprinted(k, *lora_requests) -> None:
    """Has KVBMScheduler ``k``'s adapter thread fingerprint these adapters'
    files as they are now, as it does after their next request arrives (a
    request whose adapter it has not fingerprinted yet is a miss). A check
    already under way may have read the files before they changed (a loaded
    machine): it ends first, so the check asked here starts after the call."""
    assert k.adapters.fingerprints.settled(60)
    for lora in lora_requests:
        k.adapters.fingerprints.get(lora.lora_path)
    assert k.adapters.fingerprints.settled(60)
