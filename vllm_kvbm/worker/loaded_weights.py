"""The weights this worker runs, as a digest of the parameters in memory.

Keys name the model's files as loaded (fingerprints.py), but vLLM can change
the weights in memory afterwards: its weight-transfer API (``update_weights``),
``reload_weights``, or any function sent through ``collective_rpc``. RL
frameworks reset vLLM's prefix cache after such a sync; the scheduler side
sees that reset and starts a new weights epoch, which the next connector
metadata carries (scheduler/weights_epochs.py). On it, each worker digests
its parameters and buffers again and reports a label: "" while they equal
what it loaded (the keys name the files then), else their digest, which
then joins the keys, so engines that received the same update share pages
again. Until its digest of an epoch is done, and whenever the labels a job
was keyed under are not its own, a worker refuses the job: a store is not
cached, a load is recomputed.

vLLM's own weight-changing methods on the worker (``update_weights``,
``reload_weights``, ``wake_up``) are observed too: after one, every job is
refused until the next prefix-cache reset (vLLM's own cache still holds the
old weights' KV until then, and pages computed on top of it must not be
named by the new weights).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
from typing import Any, Callable

logger = logging.getLogger(__name__)

# A pass over at most this many bytes of weights runs inline, on vLLM's
# worker thread, when the epoch starts (tens of milliseconds to a few hundred
# at the CPU rates of docs/benchmarks.md); a larger model's runs on a thread
# of its own, its jobs refused meanwhile.
INLINE_DIGEST_BYTES = 256 << 20
# Bytes copied from an accelerator to host memory at a time for hashing.
_CHUNK_BYTES = 64 << 20
# vLLM's worker methods that change the weights in memory (0.32 to 0.34).
_WEIGHT_CHANGES = ("update_weights", "finish_weight_update", "reload_weights", "wake_up")


def _flat_tensors(name: str, tensor) -> list[tuple[str, Any]]:
    """The plain tensors holding ``tensor``'s bytes: a tensor subclass (e.g.
    a quantized one) keeps them in inner tensors."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(tensor):
        out = []
        for attr in tensor.__tensor_flatten__()[0]:
            out += _flat_tensors(f"{name}.{attr}", getattr(tensor, attr))
        return out
    return [(name, tensor)]


def model_tensors(model) -> list[tuple[str, Any]]:
    """Every parameter and buffer of ``model`` by name, in name order."""
    named = list(model.named_parameters()) + list(model.named_buffers())
    out = []
    for name, tensor in sorted(named, key=lambda item: item[0]):
        out += _flat_tensors(name, tensor.detach())
    return out


def weights_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for _, t in model_tensors(model))


def weights_digest(model, threads: int | None = None) -> str:
    """BLAKE3 over each parameter's and buffer's name, dtype, shape and bytes
    (on every core unless ``threads``)."""
    import blake3
    import torch

    hasher = blake3.blake3(max_threads=threads or blake3.blake3.AUTO)
    for name, tensor in model_tensors(model):
        hasher.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        data = tensor.contiguous().view(-1)
        try:
            data = data.view(torch.uint8)
        except RuntimeError:  # a dtype whose bytes cannot be viewed (quantized)
            data = torch.frombuffer(bytearray(data.cpu().untyped_storage()), dtype=torch.uint8)
        if data.device.type == "cpu":
            hasher.update(data.numpy())
            continue
        for start in range(0, data.numel(), _CHUNK_BYTES):
            hasher.update(data[start:start + _CHUNK_BYTES].cpu().numpy())
    return hasher.hexdigest()


def _caller_self(match: Callable[[Any], bool]) -> Any:
    """The ``self`` of the nearest caller (within 24 frames) that ``match``
    accepts: the connector gets no reference to vLLM's model or worker, but
    vLLM registers the KV cache from methods of both. None when none does."""
    frame = sys._getframe(2)
    for _ in range(24):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if owner is not None and match(owner):
            return owner
        frame = frame.f_back
    return None


def find_model_runner() -> Any:
    """vLLM's model runner (anything with ``get_model``)."""
    return _caller_self(lambda owner: callable(getattr(owner, "get_model", None)))


def _find_worker() -> Any:
    """vLLM's worker object (the one ``collective_rpc`` calls)."""
    return _caller_self(lambda owner: hasattr(owner, "model_runner") and hasattr(owner, "rank"))


class LoadedWeights:
    """This worker's weights: their digest at load and after each weights
    epoch the scheduler starts, and whether jobs keyed under given labels
    may run (``serves``)."""

    def __init__(self, rank: int, model: Callable[[], Any] | None):
        self.rank = rank
        self._model = model  # returns the model vLLM runs now
        self._lock = threading.Lock()
        self.epoch = 0
        # "": the weights as loaded; a digest: others; None: being digested
        self.label: str | None = ""
        self._loaded: str | None = None  # digest at load (None: none taken)
        self._changed = False  # vLLM changed them since this epoch's digest
        self._unreported: list[tuple[int, int, str]] = []
        self._refusing_logged = -1

    @classmethod
    def from_vllm(cls, rank: int) -> "LoadedWeights":
        """Called while vLLM registers the KV cache: its model runner and
        worker are found on the stack; without them, each new epoch gets a
        random label (pages stored before a prefix-cache reset are then never
        looked up again by this engine)."""
        runner = find_model_runner()
        weights = cls(rank, runner.get_model if runner is not None else None)
        try:
            if runner is not None:
                weights.digest_at_load()
        except Exception as err:  # a model whose tensors cannot be read as bytes
            logger.warning("KVBM: cannot digest the model's parameters (%s)", err)
            runner = weights._model = None
        if runner is None:
            logger.warning("KVBM: without the model's parameters, each reset of vLLM's "
                           "prefix cache moves this engine's keys to a new epoch (pages are "
                           "not shared across a reset)")
        weights.observe_changes(_find_worker())
        return weights

    def digest_at_load(self) -> None:
        self._loaded = weights_digest(self._model())

    def observe_changes(self, worker: Any) -> None:
        """Wraps the weight-changing methods of vLLM's ``worker`` (on the
        instance): after one, jobs are refused until the next epoch."""
        if worker is None:
            return
        for name in _WEIGHT_CHANGES:
            method = getattr(worker, name, None)
            if callable(method) and not getattr(method, "__kvbm_observed__", False):
                setattr(worker, name, self._observed(name, method))

    def _observed(self, name: str, method):
        @functools.wraps(method)
        def changed(*args, **kwargs):
            try:
                return method(*args, **kwargs)
            finally:
                with self._lock:
                    self._changed = True
                logger.warning("KVBM: vLLM changed the weights in memory (%s): no KV is loaded "
                               "or stored until vLLM's prefix cache is reset "
                               "(reset_prefix_cache(), as after any weight update)", name)
        changed.__kvbm_observed__ = True
        return changed

    def serves(self, weights: tuple[int, tuple[str, ...]] | None) -> bool:
        """Whether jobs keyed under ``weights`` (the scheduler's epoch and
        per-rank labels) hold KV of the weights this worker runs. A newer
        epoch starts its digest pass."""
        if weights is None:
            return True  # no job keyed yet
        epoch, labels = weights
        if epoch > self.epoch:
            self._start(epoch)
        with self._lock:
            ok = (not self._changed and epoch == self.epoch and self.label is not None
                  and self.rank < len(labels) and labels[self.rank] == self.label)
        if not ok and self._refusing_logged != epoch:
            self._refusing_logged = epoch
            logger.info("KVBM: weights epoch %d: this worker's weights are not (yet) the ones "
                        "the scheduler's keys name; loads and stores refused until they are",
                        epoch)
        return ok

    def _start(self, epoch: int) -> None:
        with self._lock:
            self.epoch, self.label, self._changed = epoch, None, False
        if self._model is None:
            self._done(epoch, "unseen-" + os.urandom(16).hex())
            return
        model = self._model()
        if weights_bytes(model) <= INLINE_DIGEST_BYTES:
            self._done(epoch, weights_digest(model))
            return
        threading.Thread(target=lambda: self._done(epoch, weights_digest(model)),
                         name="kvbm-weights-digest", daemon=True).start()

    def _done(self, epoch: int, digest: str) -> None:
        label = "" if digest == self._loaded else digest
        with self._lock:
            if epoch != self.epoch:
                return  # a newer epoch started meanwhile: its pass reports
            self.label = label
            self._unreported.append((epoch, self.rank, label))

    def take_unreported(self) -> list[tuple[int, int, str]]:
        """(epoch, rank, label) of each digest pass done since the last call."""
        with self._lock:
            taken, self._unreported = self._unreported, []
        return taken
