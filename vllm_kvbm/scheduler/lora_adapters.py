"""Which LoRA adapters this engine may cache, and under what identity.

A request's keys name its adapter by name, int id, path and a fingerprint of
its files, taken on a thread of its own (scheduler/adapter_fingerprints.py):
an adapter not fingerprinted yet is a miss for that request. vLLM loads an
adapter's files once per int id and runs those weights until it evicts them
from its LoRA cache or a request asks ``load_inplace``: once the files change,
no key can say which weights a page was computed with. So an adapter is
cached only while it is as this engine first saw it and the workers report
that vLLM loaded no other weights for it (worker/lora_loads.py); after that,
never again in this engine (no lookups, no stores; its requests in flight
store nothing more). Until the scheduler hears of a load, the workers refuse
the jobs whose keys name other weights than they loaded.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable

from vllm_kvbm.keys import LoRAIdentity
from vllm_kvbm.scheduler.adapter_fingerprints import AdapterFingerprints

logger = logging.getLogger(__name__)

# (int id, fingerprint) as a request's keys name its adapter
Adapter = tuple[int, str]


def lora_identity(
    lora, fingerprint: Callable[[str], str | None] | None = None
) -> LoRAIdentity | None:
    """A LoRA request's adapter as keys see it: its name alone could be
    reused for other weights, so its id, path and a fingerprint of its files
    count too. ``fingerprint(path)``: where that comes from (default: the
    files read now, not on vLLM's threads); None when it gives none."""
    if lora is None:
        return None
    if fingerprint is None:
        from vllm_kvbm.fingerprints import adapter_fingerprint as fingerprint
    path = getattr(lora, "lora_path", "") or ""
    found = fingerprint(path)
    return None if found is None else LoRAIdentity(lora.lora_name, lora.lora_int_id, path, found)


class LoRAAdapters:
    """``stop_storing(match)``: the planner marks its requests in flight whose
    adapter ``match`` accepts as storing nothing more."""

    def __init__(self, stop_storing: Callable[[Callable[[Adapter], bool]], None]):
        self._stop_storing = stop_storing
        self.fingerprints = AdapterFingerprints()
        self._first: dict[int, LoRAIdentity] = {}  # by int id, as first seen
        self._loaded: dict[int, set[str]] = {}  # fingerprints the workers loaded
        self._changed: set[int] = set()

    def cacheable(self, lora_request) -> LoRAIdentity | None:
        """A LoRA request's adapter as its keys name it, None when the request
        may not be cached: its adapter changed, or it is not fingerprinted
        yet (a miss, never a wait: vLLM's scheduler thread calls this)."""
        if lora_request.lora_int_id in self._changed:
            return None  # never cached again: its files need no check
        lora = lora_identity(lora_request, self.fingerprints.get)
        return lora if lora is not None and self.usable(lora) else None

    def usable(self, lora: LoRAIdentity) -> bool:
        """Whether a request of this adapter may be looked up and stored."""
        first = self._first.setdefault(lora.int_id, lora)
        loaded = self._loaded.get(lora.int_id, {lora.fingerprint})
        if (
            lora.fingerprint
            and first == replace(lora, fingerprint="")
            and loaded == {lora.fingerprint}
        ):
            # First seen without local files (an HF id vLLM had not downloaded
            # yet); the workers loaded exactly the files now found. Its
            # requests before were keyed without them, and refused by the
            # workers for it: nothing of theirs is cached.
            self._first[lora.int_id] = first = lora
        if first == lora and loaded == {lora.fingerprint}:
            return True
        self._changed_now(lora.int_id, repr(lora.name))
        return False

    def loaded(self, int_id: int, fingerprint: str) -> None:
        """A worker reports the weights vLLM loaded for adapter ``int_id``:
        other ones than the keys name, or a second set of weights, and the
        adapter is not cached again."""
        weights = self._loaded.setdefault(int_id, set())
        weights.add(fingerprint)
        first = self._first.get(int_id)
        if len(weights) > 1 or (
            first is not None and first.fingerprint and first.fingerprint != fingerprint
        ):
            self._changed_now(int_id, repr(first.name) if first else "")
        elif first is not None and not first.fingerprint:
            # Keyed without its files (not local when first seen): what the
            # requests in flight computed is not stored (the workers refuse it).
            self._stop_storing(lambda adapter: adapter == (int_id, ""))

    def _changed_now(self, int_id: int, name: str) -> None:
        if int_id in self._changed:
            return
        self._changed.add(int_id)
        self._stop_storing(lambda adapter: adapter[0] == int_id)
        logger.warning(
            "KVBM: LoRA adapter %s(id %d) changed on disk since this engine first used or "
            "loaded it; its requests are no longer cached (vLLM may still run the weights it "
            "loaded). To cache it again, load the new files under a new adapter name, or "
            "restart the engine",
            f"{name} " if name else "",
            int_id,
        )
