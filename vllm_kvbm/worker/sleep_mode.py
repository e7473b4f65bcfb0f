"""vLLM's sleep mode, followed on each worker: ``sleep``, ``wake_up`` and
``discard``, as RL frameworks (verl, OpenRLHF) call them around training.

vLLM's executor sends them through ``collective_rpc``; KVBM wraps the
worker's methods (on the instance, as weight_changes.instrument does) so
that, on every supported vLLM release:

- before the memory goes, the KV memory is released (``KVBMWorker.release_kv``,
  what the connector's ``unregister_kv_caches`` calls; kv_release.py:
  transfers drained, jobs refused; it raises, and the call fails before
  anything is freed, if a transfer outlived its timeout). vLLM >= 0.33
  calls ``unregister_kv_caches`` itself right before it frees; vLLM 0.32
  does not, and the second call finds nothing to do. A
  digest pass reading the weights on a thread stops first
  (loaded_weights.LoadedWeights.suspend_checks);
- once the KV cache is mapped again (``wake_up`` with no tags or with
  ``"kv_cache"``) ``KVBMWorker.restore_kv`` (the connector's
  ``restore_kv_caches``) lets jobs run again;
- the weights' label (loaded_weights.py): level 1 keeps the weights in host
  memory and maps the same bytes back, so the label stays and pages computed
  before sleep hit after wake-up. Level 2 (and ``discard`` of ``"weights"``)
  drops them for the framework to load new ones: the label turns private at
  once, and takes the label of what is loaded after only if that load is
  identified (weight_changes.py) and writes every parameter dropped
  (``dropped_parameters``); otherwise it stays private.
"""

from __future__ import annotations

import fnmatch
import functools
import logging
from typing import TYPE_CHECKING, Any, Callable

from vllm_kvbm.worker.weight_digests import parameter_name

if TYPE_CHECKING:
    from vllm_kvbm.worker.loaded_weights import LoadedWeights

logger = logging.getLogger(__name__)


def follow(weights: "LoadedWeights", worker: Any, kv: Any) -> frozenset:
    """Wraps ``worker``'s sleep mode methods (on the instance; a later call
    points the wrappers at new ``weights`` and ``kv``); the names wrapped.
    ``kv``: what releases and restores the KV memory (the KVBMWorker)."""
    done = set()
    for name, wrapper in _WRAPPERS.items():
        method = getattr(worker, name, None)
        if not callable(method):
            continue
        held = getattr(method, "__kvbm_sleep__", None)
        if held is not None:
            held[:] = [weights, kv]
        else:
            setattr(worker, name, wrapper(worker, method, [weights, kv]))
        done.add(name)
    return frozenset(done)


def dropped_parameters(worker: Any) -> frozenset[str] | None:
    """The parameters a level-2 sleep drops, as vLLM picks them
    (``Worker._get_sleep_parameters``): the model's, and a draft model's
    (``draft.`` names) not shared with it, less those that
    ``sleep_preserve_parameter_names`` keeps. Names only: nothing is read.
    None where they cannot be listed (then no load can earn a label)."""
    try:
        return _dropped_parameters(worker)
    except Exception as err:  # noqa: BLE001 - the sleep goes on; the label stays private
        logger.warning(
            "KVBM: cannot list the parameters sleep drops (%s): this engine's "
            "pages are its own from now on",
            err,
        )
        return None


def _dropped_parameters(worker: Any) -> frozenset[str]:
    model = worker.model_runner.get_model()
    params = dict(model.named_parameters())
    get_draft = getattr(worker, "get_draft_model", None)
    draft = get_draft() if callable(get_draft) else None
    if draft is not None:
        shared = {id(p) for p in params.values()}
        params.update(
            (f"draft.{name}", p) for name, p in draft.named_parameters() if id(p) not in shared
        )
    config = getattr(getattr(worker, "vllm_config", None), "model_config", None)
    kept = list(getattr(config, "sleep_preserve_parameter_names", None) or ())
    return frozenset(
        parameter_name(name)
        for name in params
        if not any(fnmatch.fnmatchcase(name, p) for p in kept)
    )


def _arg(args: tuple, kwargs: dict, name: str, default: Any) -> Any:
    return args[0] if args else kwargs.get(name, default)


def _sleep(worker: Any, method: Callable, held: list) -> Callable:
    @functools.wraps(method)
    def sleep(*args, **kwargs):
        weights, kv = held
        level = _arg(args, kwargs, "level", 1)
        what = f"sleep(level={level})"
        kv.release_kv(what)  # raises, before anything changes, if it cannot
        try:
            weights.suspend_checks()
            if level >= 2:
                weights.dropped(dropped_parameters(worker), what)
            return method(*args, **kwargs)
        except BaseException:
            # vLLM's executor counts a failed sleep as awake and runs on
            # this memory itself: so do the copies.
            kv.restore_kv()
            weights.resume_checks()
            raise

    sleep.__kvbm_sleep__ = held
    return sleep


def _wake_up(worker: Any, method: Callable, held: list) -> Callable:
    @functools.wraps(method)
    def wake_up(*args, **kwargs):
        weights, kv = held
        tags = _arg(args, kwargs, "tags", None)
        out = method(*args, **kwargs)
        if tags is None or "kv_cache" in tags:
            kv.restore_kv()
        if tags is None or "weights" in tags:
            weights.resume_checks()
        return out

    wake_up.__kvbm_sleep__ = held
    return wake_up


def _discard(worker: Any, method: Callable, held: list) -> Callable:
    @functools.wraps(method)
    def discard(*args, **kwargs):
        weights, kv = held
        tags = tuple(_arg(args, kwargs, "tags", ()))
        what = f"discard({', '.join(tags)})"
        if "kv_cache" in tags:
            # restored by wake_up(["kv_cache"]), which vLLM expects next even
            # when the discard fails (its executor counts the tags asleep)
            kv.release_kv(what)
        if "weights" in tags:
            weights.suspend_checks()
            weights.dropped(dropped_parameters(worker), what)
        return method(*args, **kwargs)

    discard.__kvbm_sleep__ = held
    return discard


_WRAPPERS = {"sleep": _sleep, "wake_up": _wake_up, "discard": _discard}
