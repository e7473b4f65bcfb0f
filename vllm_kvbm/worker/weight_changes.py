"""Every call vLLM runs on this worker, seen where vLLM dispatches it.

vLLM changes a worker's weights in memory only through ``collective_rpc``:
its weight-transfer API (``start_weight_update``, ``update_weights``,
``finish_weight_update``), ``reload_weights``, ``apply_model``, or any
function or worker-extension method a user sends. vLLM 0.32 dispatches these
in one place per executor, in the worker's process: the multiprocessing
executor's ``WorkerProc._execute_worker_rpc`` (one process per rank) and the
single-process executor's ``UniProcExecutor.collective_rpc``. KVBM wraps that
place once, on the instance it finds on the stack while vLLM registers the
KV cache, and sorts each call by its method:

- reviewed as read-only (read_only_rpcs.READ_ONLY: every step, startup,
  LoRA, health): passed on, at the cost of a set lookup;
- sleep mode's (read_only_rpcs.SLEEP_MODE: ``sleep``, ``wake_up``,
  ``discard``): the worker's methods are wrapped (sleep_mode.py), which
  keep the label across a level-1 sleep and drop it at level 2;
- identified (read_only_rpcs.IDENTIFIED): the worker's method is wrapped
  (``instrument``) so that the (name, tensor) pairs it hands to the model's
  ``load_weights`` are digested as they pass (weight_digests.py), and the
  weights get a label of what was loaded;
- anything else (a function, an unknown method): the worker moves to a
  private label before it runs (loaded_weights.LoadedWeights.unidentified).

Ray's executor binds its actors' methods when it creates them: no place to
wrap, so an engine on it keeps its pages to itself (``watch`` returns False).
"""

from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING, Any, Callable

from vllm_kvbm import opened_files
from vllm_kvbm.worker.read_only_rpcs import IDENTIFIED, LOADING_TRANSFER_ENGINES, READ_ONLY
from vllm_kvbm.worker.weight_digests import LoadDigest, loads_digested

if TYPE_CHECKING:
    from vllm_kvbm.worker.loaded_weights import LoadedWeights

_STACK_DEPTH = 64


def watch(weights: "LoadedWeights", worker: Any, followed: frozenset = frozenset()) -> str | None:
    """Routes this process's collective_rpc calls through ``weights`` and
    instruments ``worker``'s identified methods; the dispatch place wrapped
    (None: none found, nothing wrapped). ``followed``: methods of ``worker``
    already wrapped to follow what they do (sleep_mode.py), passed on."""
    owner, kind = _find_dispatch()
    if owner is None:
        return None
    passing = (
        frozenset(READ_ONLY)
        | followed
        | (instrument(weights, worker) if worker is not None else frozenset())
    )
    if kind == "WorkerProc":
        _wrap(owner, "_execute_worker_rpc", weights, passing, lambda request: request[0])
    else:
        _wrap(
            owner,
            "collective_rpc",
            weights,
            passing,
            lambda *args, **kwargs: args[0] if args else kwargs.get("method"),
        )
    return kind


def _find_dispatch() -> tuple[Any, str]:
    """vLLM's object that dispatches collective_rpc in this process."""
    frame = sys._getframe(2)
    for _ in range(_STACK_DEPTH):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if owner is not None:
            if callable(getattr(owner, "_execute_worker_rpc", None)) and hasattr(owner, "worker"):
                return owner, "WorkerProc"
            if callable(getattr(owner, "collective_rpc", None)) and hasattr(owner, "driver_worker"):
                return owner, "UniProcExecutor"
        frame = frame.f_back
    return None, ""


def _wrap(
    owner: Any, attr: str, weights: "LoadedWeights", passing: frozenset, method_of: Callable
) -> None:
    """Wraps ``owner.attr`` (on the instance) once; a later call only points
    the wrapper at new ``weights``."""
    current = getattr(owner, attr)
    if getattr(current, "__kvbm_watch__", None) is not None:
        current.__kvbm_watch__[:] = [weights, passing]
        return
    watched = [weights, passing]

    @functools.wraps(current)
    def dispatch(*args, **kwargs):
        method = method_of(*args, **kwargs)
        weights, passing = watched
        if isinstance(method, str) and method in passing:
            return current(*args, **kwargs)
        with weights.unidentified(_describe(method)):
            return current(*args, **kwargs)

    dispatch.__kvbm_watch__ = watched
    setattr(owner, attr, dispatch)


def _describe(method: Any) -> str:
    if isinstance(method, str):
        return f"collective_rpc({method!r})"
    name = getattr(method, "__qualname__", None)
    return f"collective_rpc(<function {name}>)" if name else "collective_rpc(<a function>)"


# ---- the changes KVBM identifies ---------------------------------------------------


class _Session:
    """A weight-transfer update: start_weight_update ... finish_weight_update."""

    def __init__(self, base: str, identified: bool):
        self.base = base
        self.digest = LoadDigest()
        self.ok = identified


def instrument(weights: "LoadedWeights", worker: Any) -> frozenset:
    """Wraps ``worker``'s identified methods (on the instance); the names
    wrapped (a method not wrapped counts as an unidentified change)."""
    done = set()
    for name in IDENTIFIED:
        method = getattr(worker, name, None)
        if not callable(method):
            continue
        if getattr(method, "__kvbm_weights__", None) is not None:
            method.__kvbm_weights__[0] = weights
        else:
            setattr(worker, name, _WRAPPERS[name](weights, worker, method))
        done.add(name)
    return frozenset(done)


def _model(worker: Any):
    return worker.model_runner.get_model()


def _reload_weights(weights: "LoadedWeights", worker: Any, method: Callable) -> Callable:
    held = [weights]

    @functools.wraps(method)
    def reload_weights(*args, **kwargs):
        weights = held[0]
        base = weights.begin_change("reload_weights")
        mark = opened_files.count()
        digest = LoadDigest()
        label = None
        try:
            with loads_digested(_model(worker), digest):
                out = method(*args, **kwargs)
            label = weights.load_label(base, digest, opened_files.since(mark))
            return out
        finally:
            weights.end_change(label, "reload_weights", digest.names, digest.params)

    reload_weights.__kvbm_weights__ = held
    return reload_weights


def _start_weight_update(weights: "LoadedWeights", worker: Any, method: Callable) -> Callable:
    held = [weights]

    @functools.wraps(method)
    def start_weight_update(*args, **kwargs):
        weights = held[0]
        engine = getattr(worker, "weight_transfer_engine", None)
        kind = f"{type(engine).__module__}.{type(engine).__qualname__}"
        # vLLM 0.34's NCCL engine with use_load_plan copies planned updates
        # straight into the parameters, past load_weights
        identified = kind in LOADING_TRANSFER_ENGINES and not any(
            getattr(engine, attr, None) is not None for attr in ("_plan", "_plan_metadata")
        )
        base = weights.begin_change("start_weight_update")
        try:
            out = method(*args, **kwargs)
        except BaseException:
            weights.end_change(None, "start_weight_update")
            raise
        weights.session = _Session(base, identified)
        return out

    start_weight_update.__kvbm_weights__ = held
    return start_weight_update


def _update_weights(weights: "LoadedWeights", worker: Any, method: Callable) -> Callable:
    held = [weights]

    @functools.wraps(method)
    def update_weights(*args, **kwargs):
        weights = held[0]
        session = weights.session
        if session is None:  # not between start and finish: nothing vLLM would load
            with weights.unidentified("update_weights"):
                return method(*args, **kwargs)
        try:
            with loads_digested(_model(worker), session.digest):
                return method(*args, **kwargs)
        except BaseException:
            session.ok = False  # vLLM ends the update: partly loaded
            raise

    update_weights.__kvbm_weights__ = held
    return update_weights


def _finish_weight_update(weights: "LoadedWeights", worker: Any, method: Callable) -> Callable:
    held = [weights]

    @functools.wraps(method)
    def finish_weight_update(*args, **kwargs):
        weights = held[0]
        session, weights.session = weights.session, None
        if session is None:
            with weights.unidentified("finish_weight_update"):
                return method(*args, **kwargs)
        label = None
        try:
            out = method(*args, **kwargs)
            if session.ok:
                label = weights.load_label(session.base, session.digest, [])
            return out
        finally:
            weights.end_change(
                label, "a weight update", session.digest.names, session.digest.params
            )

    finish_weight_update.__kvbm_weights__ = held
    return finish_weight_update


_WRAPPERS = {
    "reload_weights": _reload_weights,
    "start_weight_update": _start_weight_update,
    "update_weights": _update_weights,
    "finish_weight_update": _finish_weight_update,
}
