"""Layer-wise copies, the worker's side: stores posted as vLLM reports each
layer written, layered loads started before the forward pass and waited for
layer by layer, and both ended after it (layer_copies.py says how)."""

from __future__ import annotations

import logging
import time

from vllm_kvbm.messages import KVBMConnectorMetadata, TransferJob
from vllm_kvbm.worker import lora_loads

logger = logging.getLogger(__name__)


class LayeredSteps:
    """Part of ``KVBMWorker`` (worker.py, which holds the state): layer-wise copies."""

    @property
    def copies_by_layer(self) -> bool:
        return self._layer_copies is not None

    def save_layer(self, layer_name: str, meta: KVBMConnectorMetadata) -> None:
        """vLLM's ``save_kv_layer``: the layer's KV of this step is written."""
        if self._layer_copies is not None:
            self._layer_copies.layer_saved(layer_name, meta, self._storable)

    def _storable(self, meta: KVBMConnectorMetadata) -> list[TransferJob]:
        """The step's stores ``start_stores`` will copy (what ``_refused``
        and a released KV cache leave), found without failing any."""
        if self.kv_released is not None or not self.weights.serves(meta.weights):
            return []
        return [j for j in meta.stores if not j.refuse and not lora_loads.refuses(j.adapter)]

    def _start_layered(self, jobs: list[TransferJob]) -> None:
        """Synchronous host-tier loads, copied layer by layer as the forward
        pass reaches each layer; failed (vLLM recomputes their blocks) where
        this worker cannot."""
        refused = jobs
        if self._layer_copies is not None and self.kv_released is None and not self._layered_off:
            refused = self._layer_copies.load(jobs)
        for job in refused:
            self._complete(job, False, ok=False, started=time.perf_counter())

    def wait_layer(self, layer_name: str) -> None:
        """vLLM's ``wait_for_layer_load``: the layer's loads of this step are in."""
        if self._layer_copies is not None:
            self._layer_copies.layer_needed(layer_name)

    def _end_layered(self) -> None:
        """After the forward pass: the step's layered loads reported (in
        ``loads_done``). One whose layers were not all waited for before
        their attention ran failed: vLLM recomputes its blocks and drops the
        step's token for the request; this worker loads no more layer by layer."""
        ended = self._layer_copies.loads_ended() if self._layer_copies is not None else None
        if ended is None:
            return
        step, waited = ended
        if not waited and not self._layered_off:
            logger.error(
                "KVBM: layers %s ran attention without waiting for their loads; those "
                "requests are recomputed, and host-tier hits are loaded before the step "
                "from now on",
                sorted(step.layers - step.waited),
            )
            self._meta.layered_workers -= 1
            self._layered_off = True
        # What a layered load cost the request: the forward pass's waits for it.
        started = time.perf_counter() - step.wait_s
        for job in step.jobs:
            self._complete(job, False, ok=waited and step.failed is None, started=started)
