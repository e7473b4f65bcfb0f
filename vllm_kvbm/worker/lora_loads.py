"""The LoRA weights vLLM loaded in this worker process, by adapter int id.

The scheduler keys an adapter's pages by the fingerprint of its files when a
request arrives (fingerprints.adapter_fingerprint), but vLLM runs the weights
it read when it loaded the adapter: at ``/v1/load_lora_adapter``, at the first
request that needs it, again after evicting it from its LoRA cache, or on a
``load_inplace`` request. Files rewritten in between make the two differ. So
each load is observed here (``WorkerLoRAManager._load_adapter``, the one place
vLLM 0.32 to 0.34 read adapter files), fingerprinted from the same files, and
a job whose keys name other weights than the ones this worker loaded for its
adapter is refused (worker.py): a store is not cached, a load is recomputed.
The loads are also reported to the scheduler, which then stops caching the
adapter (scheduler/lora_adapters.py).
"""

from __future__ import annotations

import functools
import logging
import threading

logger = logging.getLogger(__name__)

# Stands for weights whose files changed while vLLM read them: equal to no
# fingerprint, so every job of that adapter is refused.
CHANGED_WHILE_LOADING = "changed-while-loading"

_lock = threading.Lock()
# int id -> every fingerprint loaded for it in this process
_loaded: dict[int, set[str]] = {}
# (int id, fingerprint) loads not yet reported to the scheduler
_unreported: list[tuple[int, str]] = []
_watching = False


def watch() -> bool:
    """Observes vLLM's adapter loads from now on (once per process); False
    when this vLLM has no ``_load_adapter`` to observe (then a rewrite is only
    seen at the next request's arrival, by the scheduler)."""
    global _watching
    with _lock:
        if _watching:
            return True
        try:
            from vllm.lora.worker_manager import WorkerLoRAManager
        except ImportError:
            return False  # the worker side without vLLM: no adapter is ever loaded
        try:
            original = WorkerLoRAManager._load_adapter
        except AttributeError as err:
            logger.warning(
                "KVBM: cannot observe vLLM's LoRA loads (%s): an adapter rewritten "
                "in place is seen only at its next request's arrival",
                err,
            )
            return False
        WorkerLoRAManager._load_adapter = _observed(original)
        _watching = True
        return True


def _observed(original):
    @functools.wraps(original)
    def _load_adapter(self, lora_request):
        from vllm_kvbm.fingerprints import adapter_stat

        path = getattr(lora_request, "lora_path", "") or ""
        before = adapter_stat(path)
        model = original(self, lora_request)
        loaded(lora_request.lora_int_id, path, before)
        return model

    _load_adapter.__kvbm_observed__ = True
    return _load_adapter


def loaded(int_id: int, path: str, before: tuple | None) -> str:
    """Records that vLLM read adapter ``int_id`` from ``path``, whose files'
    stat was ``before`` when it started: the fingerprint of what it read.
    (Imported here: the worker side also runs with only PyTorch and NIXL,
    where no adapter is ever loaded.)"""
    from vllm_kvbm.fingerprints import adapter_fingerprint, adapter_stat

    fingerprint = adapter_fingerprint(path)
    # No files before: vLLM downloaded them (an HF id, content addressed)
    # during the load, and read what is there now.
    if before is not None and adapter_stat(path) != before:
        fingerprint = CHANGED_WHILE_LOADING
    with _lock:
        _loaded.setdefault(int_id, set()).add(fingerprint)
        _unreported.append((int_id, fingerprint))
    return fingerprint


def refuses(adapter: tuple[int, str] | None) -> bool:
    """Whether a job whose keys name ``adapter`` (int id, fingerprint) holds
    or would hold KV of other weights than this worker loaded for that id.
    An adapter never loaded here has no weights to differ from."""
    if adapter is None:
        return False
    with _lock:
        weights = _loaded.get(adapter[0])
        return bool(weights) and weights != {adapter[1]}


def take_unreported() -> list[tuple[int, str]]:
    with _lock:
        taken = _unreported[:]
        _unreported.clear()
    return taken
