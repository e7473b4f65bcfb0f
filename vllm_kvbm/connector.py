"""KVBMConnector: the class vLLM loads from ``--kv-transfer-config``.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVBMConnector",
        "kv_connector_module_path": "vllm_kvbm.connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"host_cache_size": "4GiB"}}'

vLLM creates one instance per process: a scheduler-role one, which delegates
to ``KVBMScheduler``, and a worker-role one per worker, which delegates to
``KVBMWorker``. This file only routes calls; for a model whose KV cache
KVBM does not serve (engine_info.kept_out_reason), to neither.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from vllm_kvbm.config import KVBMConfigError, check_vllm_version, load_config
from vllm_kvbm.engine_info import engine_info, kept_out_reason
from vllm_kvbm.messages import KVBMConnectorMetadata
from vllm_kvbm.metrics import KVBMConnectorStats, KVBMPromMetrics, StandaloneMetrics
from vllm_kvbm.scheduler import request_params

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


# Tier of a hit -> vLLM's label for it (vllm:prompt_tokens_cached_by_source).
# vLLM 0.32 to 0.34 have no member for a remote cache server.
_HIT_SOURCE = {
    "host": CacheHitSource.HOST,
    "pool": CacheHitSource.HOST,
    "disk": CacheHitSource.DISK,
    "peer": CacheHitSource.P2P,
}


def extensible_kv_cache_note(cache_config) -> str | None:
    """What KVBM does with vLLM 0.34's extensible KV cache, when it is on."""
    if not getattr(cache_config, "enable_extensible_kv_cache", False):
        return None
    return (
        "KVBM: vLLM's extensible KV cache is on: KVBM registers none of its memory and "
        "copies only the blocks vLLM hands it; while vLLM releases that memory (sleep, "
        "release_kv_cache_memory(), a weight update borrowing it) KVBM's copies are "
        "finished first and none start until it is back"
    )


def sleep_mode_refusal() -> str | None:
    """Why KVBM cannot follow vLLM's sleep mode on this platform (None: it
    can). On CUDA and ROCm the workers copy GPU KV by address and vLLM's
    cumem allocator keeps the addresses across sleep; on the CPU build sleep
    frees nothing. Elsewhere the KV memory would be NIXL's to register."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike() or current_platform.is_cpu():
        return None
    return (
        f"enable_sleep_mode: KVBMConnector follows vLLM's sleep mode on CUDA and ROCm GPUs "
        f"and vLLM's CPU build, not on {current_platform.device_name}; start vLLM "
        f"without --enable-sleep-mode"
    )


class KVBMConnector(KVConnectorBase_V1, SupportsHMA):
    # SupportsHMA keeps vLLM's hybrid KV cache manager on: without it vLLM
    # turns it off and hybrid Mamba/GDN models stop at startup. Models of
    # several KV cache groups start and are kept out of KVBM (kept_out_reason).

    # Used only by vLLM's default get_external_cache_hit_sources (overridden).
    _cache_hit_source = CacheHitSource.HOST

    @property
    def requires_kv_delivery(self) -> bool:
        # A cache: a store dropped by preemption is only a future miss.
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        from vllm_kvbm.engine_info import requested_kv_cache_layout

        # A block contiguous across layers: a page of consecutive blocks is one copy.
        return requested_kv_cache_layout(vllm_config)

    # ---- what vLLM asks the class (newer releases; older ones never call) ---
    # tools/vllm_compat.py: ADDED_IN says which release added each.

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: "KVTransferConfig") -> bool:
        # The workers drain and stop their copies while the KV memory is
        # released (unregister_kv_caches) and go on at the same addresses
        # once it is back (restore_kv_caches); on 0.32 (which never asks)
        # __init__ refuses where this is False.
        return sleep_mode_refusal() is None

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: "KVTransferConfig") -> bool:
        # Block keys cover a block's own tokens (keys.py), not the tokens an
        # EAGLE drafter reads after it, so a loaded block's last drafter KV may
        # come from another continuation: vLLM keeps dropping that block.
        return False

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: "KVTransferConfig"):
        from vllm.config.kv_transfer import KVCacheAccess  # vLLM >= 0.34

        # GPU KV is copied by address on the copy engines (worker/copy_engine.py),
        # never registered with NIXL or UCX: any allocation works, the
        # extensible KV cache's included.
        return KVCacheAccess.IN_PROCESS

    def __init__(
        self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"
    ):
        check_vllm_version()
        if getattr(vllm_config.model_config, "enable_sleep_mode", False):
            if (refusal := sleep_mode_refusal()) is not None:
                raise KVBMConfigError(refusal)
        super().__init__(vllm_config, role, kv_cache_config)
        self.config = load_config(self._kv_transfer_config.kv_connector_extra_config)
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            # vLLM reads this right after creating the scheduler's connector.
            # A cache must never fail a request: a page that cannot be loaded
            # (corrupt, evicted, tier down) is recomputed instead.
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
            if role == KVConnectorRole.SCHEDULER:
                logger.info(
                    "KVBM: kv_load_failure_policy set to 'recompute': blocks "
                    "that fail to onboard are recomputed, never an error"
                )
        self.sched: KVBMScheduler | None = None
        self.worker: KVBMWorker | None = None
        # Not None: KVBM keeps this model's KV out of its tiers (no lookup, no
        # store, no memory taken), and every call below returns what "nothing
        # cached, nothing in flight" is.
        self.kept_out = kept_out_reason(vllm_config, kv_cache_config)
        if self.kept_out is not None:
            if role == KVConnectorRole.SCHEDULER:
                logger.warning(self.kept_out)
            return
        self.info = engine_info(
            vllm_config, kv_cache_config, self.config.namespace, self.config.page_tokens
        )
        num_slots = self.config.host_slots(self.info.page_bytes, self.info.page_blocks)
        self._num_blocks = kv_cache_config.num_blocks
        # Each process imports only its own side: the scheduler process never
        # loads NIXL or LMCache, a worker never the scheduler's bookkeeping.
        if role == KVConnectorRole.SCHEDULER:
            from vllm_kvbm.scheduler.key_source import vllm_block_hashes
            from vllm_kvbm.scheduler.kv_events import kv_events
            from vllm_kvbm.scheduler.lookups import lower_tiers
            from vllm_kvbm.scheduler.planner import KVBMScheduler

            hashes, key_source = vllm_block_hashes(
                vllm_config, kv_cache_config, self.info.block_size
            )
            logger.info("KVBM: %s", key_source)
            # once per engine: the scheduler process, not each worker
            logger.info(
                "KVBM: configuration (values set, with their source): %s", self.config.describe()
            )
            logger.info(
                "KVBM: this engine takes %s",
                self.config.engine_totals(num_slots, self.info.page_bytes, self.info.num_workers),
            )
            self.sched = KVBMScheduler(
                self.info,
                num_slots,
                self.config.offload_decode_blocks,
                metrics_sink=self._standalone_metrics(),
                lower=lower_tiers(self.config, self.info),
                load_split=self.config.load_split,
                vllm_hashes=hashes,
                kv_events=kv_events(vllm_config, kv_cache_config, self.info),
            )
        else:
            from vllm_kvbm.worker.worker import KVBMWorker

            self.worker = KVBMWorker(
                self.info,
                num_slots,
                self.config.nixl_backend,
                agent_name=f"kvbm-{os.getpid()}",
                host_copy_path=self.config.host_copy_path,
                tier_write_queue_pages=self.config.tier_write_queue_pages,
                tier_read_timeout_s=self.config.tier_read_timeout_s,
                # A draft model's step reports the connector's results before its
                # wait_for_save: a layered load's failure would reach vLLM a step late.
                layered_loads=vllm_config.speculative_config is None,
            )

    def _standalone_metrics(self) -> StandaloneMetrics | None:
        port = self.config.metrics_port
        if port is None:
            return None
        try:
            sink = StandaloneMetrics(port, self.config.metrics_host)
        except OSError as err:
            # Metrics must never take the engine down: serve without them.
            logger.warning(
                "KVBM: metrics_port %d unavailable (%s); kvbm_* metrics "
                "stay on vLLM's /metrics only",
                port,
                err,
            )
            return None
        logger.info("KVBM: metrics on http://%s:%d/metrics", self.config.metrics_host, port)
        return sink

    # ---- worker side ------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        if self.kept_out is not None:
            return
        assert self.worker is not None
        from vllm_kvbm.engine_info import refuse_unproven_layers
        from vllm_kvbm.worker.loaded_weights import LoadedWeights
        from vllm_kvbm.worker.tier_io import layout_fingerprint, open_tiers
        from vllm_kvbm.worker.vllm_layout import declared_block_dims, layer_specs

        refuse_unproven_layers(layer_specs(self._kv_cache_config), kv_caches)
        # Each layer's block dim from vLLM's declared KV layout, not guessed.
        dims = declared_block_dims(self._kv_cache_config, kv_caches)
        self.worker.register_kv_caches(kv_caches, self._num_blocks, dims)
        if (note := extensible_kv_cache_note(self._vllm_config.cache_config)) is not None:
            logger.info(note)
        # Bound into every page this worker stores: read back only by a
        # worker whose KV cache lays out the bytes alike.
        layout = layout_fingerprint(kv_caches, self._num_blocks, dims)
        rank = _tp_rank()
        for store in open_tiers(self.config, self.info, rank, layout):
            self.worker.add_tier(store, rank)
        # vLLM registers the KV cache once the weights are loaded: their
        # digest now is what "as loaded" means (worker/loaded_weights.py).
        # Sleep mode's calls on this worker are followed from here on
        # (worker/sleep_mode.py): the same release and restore as below.
        self.worker.weights = LoadedWeights.from_vllm(rank, kv=self.worker)
        if (
            getattr(self._vllm_config.model_config, "enable_sleep_mode", False)
            and not self.worker.weights.follows_sleep
        ):
            raise KVBMConfigError(
                "enable_sleep_mode: KVBM cannot find vLLM's worker to follow its sleep calls "
                "(its copies could run while the KV memory is released); start vLLM "
                "without --enable-sleep-mode"
            )

    def unregister_kv_caches(self) -> None:
        # vLLM >= 0.33 calls this right before it frees the KV cache's memory
        # (sleep, discard, release_kv_cache_memory(), 0.34's weight updates
        # that borrow the extensible KV cache: tests/unit/test_extensible_kv_cache.py
        # reads those call sites); on 0.32 the worker's sleep mode calls make
        # the same call (worker/sleep_mode.py). The worker's copies end first,
        # and none starts until restore_kv_caches; one that outlived its
        # timeout raises here, before anything is freed (worker/kv_release.py).
        if self.worker is not None:  # (the scheduler side and a model kept out copy nothing)
            self.worker.release_kv("vLLM releases the KV cache's memory")

    def restore_kv_caches(self) -> None:
        # The KV memory is mapped again, at the addresses it had.
        if self.worker is not None:
            self.worker.restore_kv()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self.kept_out is not None:
            return
        assert self.worker is not None and isinstance(kv_connector_metadata, KVBMConnectorMetadata)
        self.worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        if self.kept_out is not None:
            return
        assert self.worker is not None
        self.worker.start_loads(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        # A host-tier hit loaded layer by layer (worker/layer_copies.py, on
        # CPU where a core is free) is waited for here; other loads are
        # asynchronous (the request waits in WAITING_FOR_REMOTE_KVS).
        if self.kept_out is None and self.worker is not None and self.worker.copies_by_layer:
            self.worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        # Stores are posted once per step in wait_for_save; on CPU, where a
        # core is free, each layer's part is copied as it is written.
        if self.kept_out is None and self.worker is not None and self.worker.copies_by_layer:
            self.worker.save_layer(layer_name, self._meta())

    def wait_for_save(self) -> None:
        if self.kept_out is not None:
            return
        assert self.worker is not None
        self.worker.start_stores(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        if self.kept_out is not None:
            return set(), set()
        assert self.worker is not None
        return self.worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]):
        # What get_finished says, and the requests whose load failed (a model
        # of several KV cache groups reports those, not block ids).
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        sending, recving = self.get_finished(finished_req_ids)
        failed = self.worker.take_failed_recving(recving) if self.worker is not None else set()
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.kept_out is not None:
            return set()
        assert self.worker is not None
        return self.worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self):
        return self.worker.build_worker_meta() if self.worker is not None else None

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()

    def _meta(self) -> KVBMConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVBMConnectorMetadata)
        return meta

    # ---- scheduler side ---------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.kept_out is not None:
            return
        assert self.sched is not None
        self.sched.bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self.kept_out is not None:
            return 0, False
        assert self.sched is not None
        return self.sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        if self.kept_out is not None:
            return
        assert self.sched is not None
        self.sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(
        self, request: "Request", num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        # Host, disk and remote hits apart in vLLM's own per-source metrics.
        if self.kept_out is not None:
            return {}
        assert self.sched is not None
        split: dict[CacheHitSource, int] = {}
        for tier, tokens in self.sched.hit_sources(request, num_external_tokens).items():
            source = _HIT_SOURCE.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
            split[source] = split.get(source, 0) + tokens
        return split

    def may_load_async(self, request: "Request") -> bool:
        # vLLM >= 0.34: with --max-num-inflight-kv-loads, requests this says
        # True for may start their (asynchronous) load while the batch is full.
        return self.sched is not None and self.sched.may_load_async(request)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        if self.kept_out is not None:
            return KVBMConnectorMetadata()
        assert self.sched is not None
        return self.sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        if self.kept_out is not None:
            return
        assert self.sched is not None
        self.sched.update_connector_output(connector_output)

    def request_finished(
        self, request: "Request", block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # vLLM calls this (SupportsHMA) once a request is done in every KV
        # cache group. The scheduler side keeps its own books of the blocks
        # its stores read (one group when it serves the model), so the ids
        # vLLM passes are not needed.
        if self.kept_out is not None:
            delay_free, params = False, None
        else:
            assert self.sched is not None
            delay_free, params = self.sched.request_finished(request)
        # refused kv_transfer_params are named in the response's (request_params.py)
        return delay_free, request_params.report(request.kv_transfer_params) or params

    def has_pending_push_work(self) -> bool:
        # Keeps the engine stepping while stores are in flight, so their
        # completions (and delayed block frees) are collected.
        return self.sched is not None and self.sched.has_pending_work()

    def reset_cache(self) -> bool | None:
        if self.kept_out is not None:
            return True  # nothing held
        assert self.sched is not None
        return self.sched.reset_cache()

    def take_events(self):
        # Pages stored to and removed from the host, disk and remote tiers:
        # vLLM's scheduler publishes them with its own (--kv-events-config).
        return self.sched.events.take() if self.sched is not None else ()

    def get_kv_connector_stats(self) -> KVBMConnectorStats | None:
        if self.sched is None:
            return None
        delta = self.sched.stats.take()
        return KVBMConnectorStats(data=delta) if delta else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return KVBMConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KVBMPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except Exception:  # no TP group (single process): rank 0
        return 0
