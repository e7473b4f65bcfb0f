"""Which peer holds a request's prefix, as a router says it in the request's
``kv_transfer_params``: the control endpoint of the engine (or kvbm-pool)
whose shared pool the request's pages are read from (the "peer" tier).

Three shapes are taken, the first one present:

- Dynamo's ``router_hint``: ``{"source_control_endpoint": "tcp://HOST:PORT",
  "block_hashes": [u64, ...]}`` (the router's hashes of the request's blocks
  from its first, which the router indexes);
- the versioned envelope ``kv_hint``: ``{"protocol_version": ..., "actions":
  [{"action_type": "kv.fetch", "action_version": "1.x", "payload": {...the
  router_hint fields...}}]}`` (its first ``kv.fetch`` action);
- vLLM's ``remote_kv_source``: ``{"remote_host": HOST, "remote_port": PORT,
  ...}``.

Only the endpoint is used: KVBM asks that peer for the request's own page
keys (which name the model, the weights and every setting the KV depends
on), never for the router's block hashes, which are checked for shape only.
A peer that does not hold a page, or holds it under another scope, is a miss.
"""

from __future__ import annotations

from typing import Any, Mapping

from vllm_kvbm.tiers.peer.protocol import parse_endpoint

ROUTER_HINT = "router_hint"
KV_HINT = "kv_hint"
REMOTE_KV_SOURCE = "remote_kv_source"
HINT_KEYS = (ROUTER_HINT, KV_HINT, REMOTE_KV_SOURCE)
_U64 = 1 << 64


class HintError(ValueError):
    """A hint of the wrong shape; names the field and the fix."""


def peer_endpoint(params: Mapping[str, Any]) -> str | None:
    """The rank-0 control endpoint the request's hint names (None: no hint)."""
    if ROUTER_HINT in params:
        return _from_router_hint(ROUTER_HINT, params[ROUTER_HINT])
    if KV_HINT in params:
        return _from_envelope(params[KV_HINT])
    if REMOTE_KV_SOURCE in params:
        return _from_remote_kv_source(params[REMOTE_KV_SOURCE])
    return None


def _from_router_hint(field: str, hint: Any) -> str:
    if not isinstance(hint, Mapping):
        raise HintError(
            f"{field}: expected an object with source_control_endpoint, got "
            f'{hint!r}; send {{"source_control_endpoint": "tcp://HOST:PORT"}}'
        )
    endpoint = _endpoint(f"{field}.source_control_endpoint", hint.get("source_control_endpoint"))
    hashes = hint.get("block_hashes")
    if hashes is not None and (
        not isinstance(hashes, list) or not all(type(h) is int and 0 <= h < _U64 for h in hashes)
    ):
        raise HintError(
            f"{field}.block_hashes: expected a list of unsigned 64-bit integers, got {hashes!r}"
        )
    return endpoint


def _from_envelope(envelope: Any) -> str:
    actions = envelope.get("actions") if isinstance(envelope, Mapping) else None
    if not isinstance(actions, list):
        raise HintError(f"{KV_HINT}: expected an object with a list of actions, got {envelope!r}")
    for action in actions:
        if not isinstance(action, Mapping) or action.get("action_type") != "kv.fetch":
            continue
        version = str(action.get("action_version", "1"))
        if version.split(".")[0] != "1":
            raise HintError(
                f"{KV_HINT}: kv.fetch action_version {version!r} is not 1.x, the version KVBM reads"
            )
        return _from_router_hint(f"{KV_HINT}.actions[].payload", action.get("payload"))
    raise HintError(f"{KV_HINT}: no kv.fetch action among {len(actions)}")


def _from_remote_kv_source(source: Any) -> str:
    if not isinstance(source, Mapping):
        raise HintError(
            f"{REMOTE_KV_SOURCE}: expected an object with remote_host and "
            f"remote_port, got {source!r}"
        )
    host, port = source.get("remote_host"), source.get("remote_port")
    if not isinstance(host, str) or not host or type(port) is not int:
        raise HintError(
            f"{REMOTE_KV_SOURCE}: expected remote_host (a string) and remote_port "
            f"(an integer), got {host!r} and {port!r}"
        )
    bracketed = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return _endpoint(REMOTE_KV_SOURCE, f"tcp://{bracketed}:{port}")


def _endpoint(field: str, text: Any) -> str:
    try:
        host, port = parse_endpoint(text)
    except ValueError as err:
        raise HintError(f"{field}: {err}") from None
    return f"tcp://{host}:{port}"
