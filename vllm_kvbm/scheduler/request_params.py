"""Per-request control through a request's ``kv_transfer_params``: which
tiers a request loads from and stores to, and how many tokens, read once
when the scheduler first sees the request.

The names are vLLM's offloading connector's where they mean the same
(``kv_load_tiers``, ``max_load_tokens``, ``max_offload_tokens``), LMCache's
``lmcache.skip_save``, and ``kv_store_tiers`` shaped as ``kv_load_tiers``.
Other keys are left alone: the same params may carry other connectors' keys.

vLLM gives a connector no way to refuse a request before it reaches the
engine, and an exception on the scheduler's thread stops the engine; so a
bad value is reported (a warning naming the field and the fix, and
``kvbm_error`` in the response's ``kv_transfer_params``), and the half it
belongs to is off for that request: a bad load field, no load; a bad store
field, no store (the other half as asked). Whatever it meant to restrict
stays restricted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping

from vllm_kvbm.scheduler.router_hints import HintError, peer_endpoint

logger = logging.getLogger(__name__)

TIERS = ("host", "pool", "disk", "peer", "remote")
# Each tier as vLLM's TierMatcher sees it: (medium, locality); a remote
# server's medium is its own business (None matches every medium). The pool
# is host memory of this machine, a peer's pool another machine's.
_MATCHED_AS = {
    "host": ("CPU", "LOCAL"),
    "pool": ("CPU", "LOCAL"),
    "disk": ("STORAGE", "LOCAL"),
    "peer": ("CPU", "REMOTE"),
    "remote": (None, "REMOTE"),
}
_MEDIUMS = ("CPU", "STORAGE")
_LOCALITIES = ("LOCAL", "REMOTE")

LOAD_TIERS = "kv_load_tiers"
STORE_TIERS = "kv_store_tiers"
MAX_LOAD = "max_load_tokens"
MAX_STORE = "max_offload_tokens"
SKIP_SAVE = "lmcache.skip_save"
ERROR_KEY = "kvbm_error"


class RequestParamsError(ValueError):
    """A bad value in a request's kv_transfer_params; names the field and the fix."""


@dataclass(frozen=True)
class RequestParams:
    """What one request allows. None: no limit."""

    load_tiers: frozenset[str] | None = None
    store_tiers: frozenset[str] | None = None
    max_load_tokens: int | None = None
    max_store_tokens: int | None = None
    # the control endpoint of the peer a router names (router_hints.py)
    peer: str | None = None
    # the params were refused: neither load nor store (error says why)
    error: str | None = None
    # the parts refused (metric_names.REFUSED_PARAMS), counted per request
    refused: tuple[str, ...] = ()

    @property
    def loads(self) -> bool:
        return self.load_tiers != frozenset() and self.max_load_tokens != 0

    @property
    def stores(self) -> bool:
        return self.store_tiers != frozenset() and self.max_store_tokens != 0

    def loadable(self, sources: list[str], hit_start_tokens: int, page_tokens: int) -> int:
        """How many pages of a hit (``sources``: each page's tier, the first
        page beginning ``hit_start_tokens`` before the first token to load)
        this request may load: up to the first page of a tier it leaves out,
        and no page that would take it past max_load_tokens."""
        n = len(sources)
        if self.load_tiers is not None:
            n = next((i for i, tier in enumerate(sources) if tier not in self.load_tiers), n)
        if self.max_load_tokens is not None:
            n = min(n, (self.max_load_tokens + hit_start_tokens) // page_tokens)
        return n

    def store_pages(self, page_tokens: int) -> int | None:
        """Pages from the prompt's start it may store (None: no limit)."""
        if self.max_store_tokens is None:
            return None
        return self.max_store_tokens // page_tokens

    def lower_tiers(self, tiers) -> tuple:
        """Of the lower tiers a spill would write, those it may store to."""
        if self.store_tiers is None:
            return tuple(tiers)
        return tuple(t for t in tiers if t in self.store_tiers)


ALL = RequestParams()


def parse(params: Mapping[str, Any] | None) -> RequestParams:
    """The request's limits, or RequestParamsError naming the (first) bad field."""
    result, errors = parse_apart(params)
    if errors:
        raise RequestParamsError(errors[0])
    return result


def parse_apart(params: Mapping[str, Any] | None) -> tuple[RequestParams, list[str]]:
    """The request's limits and what was wrong with them: a bad load field
    turns loading off and leaves storing as asked, a bad store field the
    reverse (a typo in one must not cost the other)."""
    if not params:
        return ALL, []
    if not isinstance(params, Mapping):
        err = (
            f"kv_transfer_params: expected an object, got {type(params).__name__}; "
            f'send e.g. {{"{LOAD_TIERS}": ["host"]}}'
        )
        return RequestParams(
            load_tiers=frozenset(), store_tiers=frozenset(), error=err, refused=("object",)
        ), [err]
    errors, refused = [], []
    try:
        load_tiers, max_load = _tiers(params, LOAD_TIERS), _tokens(params, MAX_LOAD)
    except RequestParamsError as err:
        errors.append(str(err))
        refused.append("load")
        load_tiers, max_load = frozenset(), None
    try:
        store_tiers, max_store = _store_fields(params)
    except RequestParamsError as err:
        errors.append(str(err))
        refused.append("store")
        store_tiers, max_store = frozenset(), None
    try:  # a bad hint is ignored: it only says where else to look
        peer = peer_endpoint(params)
    except HintError as err:
        errors.append(str(err))
        refused.append("hint")
        peer = None
    return RequestParams(
        load_tiers=load_tiers,
        store_tiers=store_tiers,
        max_load_tokens=max_load,
        max_store_tokens=max_store,
        peer=peer,
        error="; ".join(errors) or None,
        refused=tuple(refused),
    ), errors


def _store_fields(params: Mapping[str, Any]) -> tuple[frozenset[str] | None, int | None]:
    skip = params.get(SKIP_SAVE)
    if skip is not None and not isinstance(skip, bool):
        raise RequestParamsError(f"{SKIP_SAVE}: expected true or false, got {skip!r}")
    store_tiers = _tiers(params, STORE_TIERS)
    if store_tiers and "host" not in store_tiers:
        raise RequestParamsError(
            f'{STORE_TIERS}: {sorted(store_tiers)} leaves out "host", through which '
            f'every store passes; add "host", or send [] to store nothing'
        )
    max_store = _tokens(params, MAX_STORE)
    return (frozenset() if skip else store_tiers), max_store


def for_request(request) -> RequestParams:
    """``parse_apart`` of the request's params; a refused half (loading or
    storing) logs a warning once and is off for this request, the other half
    as asked."""
    params, errors = parse_apart(request.kv_transfer_params)
    if errors:
        off = " and ".join(
            what for what, on in (("loads", params.loads), ("stores", params.stores)) if not on
        )
        logger.warning(
            "request %s: %s (%s)",
            request.request_id,
            "; ".join(errors),
            f"it {off} no KV" if off else "the hint is ignored",
        )
    return params


def report(params: Mapping[str, Any] | None) -> dict[str, str] | None:
    """What the response's kv_transfer_params says of refused params."""
    _, errors = parse_apart(params)
    return {ERROR_KEY: "; ".join(errors)} if errors else None


def _tokens(params: Mapping[str, Any], name: str) -> int | None:
    raw = params.get(name)
    if raw is None:
        return None
    if type(raw) is not int or raw < 0:  # bool is an int: refused too
        raise RequestParamsError(f"{name}: expected a whole number of tokens >= 0, got {raw!r}")
    return raw


def _tiers(params: Mapping[str, Any], name: str) -> frozenset[str] | None:
    """A list of tier names ("host", "pool", "disk", "remote") or of vLLM's tier
    matchers ({"medium": "CPU"|"STORAGE", "locality": "LOCAL"|"REMOTE"}):
    the tiers it names. [] names none."""
    raw = params.get(name)
    if raw is None:
        return None
    fix = f'send a list of {list(TIERS)} or of {{"medium": ..., "locality": ...}}'
    if not isinstance(raw, list):
        raise RequestParamsError(f"{name}: expected a list, got {raw!r}; {fix}")
    tiers = set()
    for entry in raw:
        if isinstance(entry, str):
            if entry not in TIERS:
                raise RequestParamsError(f"{name}: unknown tier {entry!r}; {fix}")
            tiers.add(entry)
        elif isinstance(entry, Mapping):
            tiers |= _matched(name, entry, fix)
        else:
            raise RequestParamsError(
                f"{name}: entry {entry!r} is neither a tier nor a matcher; {fix}"
            )
    return frozenset(tiers)


def _matched(name: str, matcher: Mapping[str, Any], fix: str) -> set[str]:
    """The tiers one vLLM TierMatcher accepts (a field it leaves out matches all)."""
    unknown = set(matcher) - {"medium", "locality"}
    if unknown:
        raise RequestParamsError(f"{name}: unknown matcher field {sorted(unknown)[0]!r}; {fix}")
    want = []
    for field, allowed in (("medium", _MEDIUMS), ("locality", _LOCALITIES)):
        value = matcher.get(field)
        if value is not None and (not isinstance(value, str) or value.upper() not in allowed):
            raise RequestParamsError(
                f"{name}: {field} {value!r} is not one of {list(allowed)}; {fix}"
            )
        want.append(None if value is None else value.upper())
    return {
        tier
        for tier, have in _MATCHED_AS.items()
        if all(w is None or h is None or w == h for w, h in zip(want, have))
    }
