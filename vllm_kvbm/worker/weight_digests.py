"""Digests of weights in memory: a model's parameters and buffers (the check
worker/loaded_weights.py runs after each prefix-cache reset), and the
(name, tensor) pairs a weight load hands to the model's ``load_weights``
(what labels an update KVBM can identify).

The pairs are digested as they pass, before the model packs, shards or
quantizes them: what vLLM keeps outside its parameters (packed copies of
linear weights on its CPU build, MXFP4 expert weights on Hopper) does not
matter, and engines that received the same update get the same digest. The
order of the names does not matter either (a checkpoint's files are listed
in directory order); a name loaded twice counts both, in order. What each
call of ``load_weights`` returns (vLLM's models return the names of the
parameters they loaded) says whether a load after a level-2 sleep wrote
every parameter the sleep dropped.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, Iterable

# Bytes copied from an accelerator to host memory at a time for hashing.
_CHUNK_BYTES = 64 << 20
# Tensors from this size on are hashed on every core.
_THREADED_BYTES = 4 << 20


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


class DigestStopped(Exception):
    """A digest pass was asked to stop (the weights' memory is about to go)."""


def _update(hasher, name: str, tensor, stop=None) -> None:
    """Feeds one plain tensor's name, dtype, shape and bytes to ``hasher``;
    ``stop`` (a threading.Event) set: DigestStopped before the next chunk."""
    import torch

    hasher.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
    data = tensor.detach().contiguous().view(-1)
    try:
        data = data.view(torch.uint8)
    except RuntimeError:  # a dtype whose bytes cannot be viewed (quantized)
        data = torch.frombuffer(bytearray(data.cpu().untyped_storage()), dtype=torch.uint8)
    if data.device.type == "cpu":
        hasher.update(data.numpy())
        return
    for start in range(0, data.numel(), _CHUNK_BYTES):
        if stop is not None and stop.is_set():
            raise DigestStopped
        hasher.update(data[start : start + _CHUNK_BYTES].cpu().numpy())


def weights_digest(model, threads: int | None = None, stop=None) -> str:
    """BLAKE3 over each parameter's and buffer's name, dtype, shape and bytes
    (on every core unless ``threads``). ``stop``: a threading.Event that ends
    the pass (DigestStopped) before it reads another tensor or chunk."""
    import blake3

    hasher = blake3.blake3(max_threads=threads or blake3.blake3.AUTO)
    for name, tensor in model_tensors(model):
        if stop is not None and stop.is_set():
            raise DigestStopped
        _update(hasher, name, tensor, stop)
    return hasher.hexdigest()


def parameter_name(name: str) -> str:
    """A parameter's name as vLLM's loaders report it (a LoRA layer's base
    weights under the base layer's name)."""
    return name.replace(".base_layer.", ".")


class LoadDigest:
    """The (name, tensor) pairs one weight load handed to the model."""

    def __init__(self) -> None:
        self._pairs: dict[str, list[str]] = {}  # name -> digest of each tensor
        self.failed: str | None = None  # why a pair could not be digested
        # The parameters the model's load_weights calls said they loaded
        # (vLLM's models return their names); None: a call did not say.
        self.params: set[str] | None = set()

    def wrote(self, loaded) -> None:
        """What one call of the model's ``load_weights`` returned."""
        if self.params is None:
            return
        try:
            self.params |= {parameter_name(str(name)) for name in loaded}
        except TypeError:  # None, or not a collection of names
            self.params = None

    def add(self, name: str, tensor) -> None:
        import blake3

        try:
            size = tensor.numel() * tensor.element_size()
            hasher = blake3.blake3(max_threads=blake3.blake3.AUTO if size >= _THREADED_BYTES else 1)
            for inner_name, inner in _flat_tensors(str(name), tensor):
                _update(hasher, inner_name, inner)
            self._pairs.setdefault(str(name), []).append(hasher.hexdigest())
        except Exception as err:  # noqa: BLE001 - the load goes on; its label is private
            self.failed = self.failed or f"{name}: {err}"

    def passing(self, weights: Iterable) -> Iterable:
        """``weights`` as the model receives them, each pair digested as it
        passes (a list at once; an iterator as it is consumed: a packed
        transfer reuses its buffers for the next pairs)."""
        if isinstance(weights, (list, tuple)):
            for name, tensor in weights:
                self.add(name, tensor)
            return weights
        return self._each(weights)

    def _each(self, weights):
        for pair in weights:
            self.add(pair[0], pair[1])
            yield pair

    @property
    def names(self) -> set[str]:
        return set(self._pairs)

    def __bool__(self) -> bool:
        return bool(self._pairs)

    def hexdigest(self) -> str:
        import blake3

        return blake3.blake3(json.dumps(sorted(self._pairs.items())).encode()).hexdigest()


@contextlib.contextmanager
def loads_digested(model, digest: LoadDigest):
    """While in it, every call of ``model.load_weights`` hands its pairs
    through ``digest`` (an attribute of the instance, removed after)."""
    own = model.__dict__.get("load_weights")
    load = model.load_weights

    def load_weights(*args, **kwargs):
        if "weights" in kwargs:
            kwargs["weights"] = digest.passing(kwargs["weights"])
        elif args:
            args = (digest.passing(args[0]),) + args[1:]
        loaded = load(*args, **kwargs)
        digest.wrote(loaded)
        return loaded

    model.load_weights = load_weights
    try:
        yield digest
    finally:
        if own is None:
            del model.load_weights
        else:
            model.load_weights = own
