"""The reading side of a peer's control endpoint: requests with a deadline.

A ``ControlLink`` is one ZMQ DEALER socket to one endpoint: each request
carries an id, and a reply to an earlier request that timed out is dropped
when it comes late. ``peer_lookup`` asks which pages a peer's pool holds,
without NIXL: what a scheduler-side view of a peer may call (it never
touches the pool's memory; the peer reads its own table). Nothing here
waits past its deadline.
"""

from __future__ import annotations

import itertools
import time

from vllm_kvbm.tiers.peer import protocol

_ids = itertools.count(1)


class ControlLink:
    def __init__(self, endpoint: str, context=None):
        import zmq

        self._zmq = zmq
        self.endpoint = endpoint
        self._own_context = context is None
        self._ctx = context or zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # a dead peer's requests are not queued without bound
        self._sock.setsockopt(zmq.SNDHWM, 16)
        self._sock.setsockopt(zmq.RCVHWM, 16)
        self._sock.connect(endpoint)

    def request(self, message: dict, timeout_s: float) -> tuple[dict, bytes | None]:
        """The peer's reply; TimeoutError when none came within ``timeout_s``."""
        zmq = self._zmq
        rid = next(_ids)
        deadline = time.monotonic() + max(0.0, timeout_s)
        try:
            self._sock.send_multipart([b""] + protocol.encode({**message, "id": rid}), zmq.NOBLOCK)
        except zmq.Again:
            raise TimeoutError(f"{self.endpoint}: not accepting requests") from None
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{self.endpoint}: no answer within {timeout_s:g} s")
                continue
            frames = self._sock.recv_multipart(zmq.NOBLOCK)
            if len(frames) < 2 or frames[0] != b"":
                continue
            reply, blob = protocol.decode(frames[1:])
            if reply.get("id") == rid:
                return reply, blob  # an earlier request's late answer is dropped

    def close(self) -> None:
        self._sock.close()
        if self._own_context:
            self._ctx.term()


def peer_lookup(
    endpoint: str,
    file: str,
    scope: bytes | None,
    table_keys: list[bytes],
    timeout_s: float,
    link: ControlLink | None = None,
) -> list[bool]:
    """Which of ``table_keys`` the pool file ``file`` at ``endpoint`` (the
    endpoint of this rank: protocol.rank_endpoint) holds now. ``scope``: the
    file's scope digest, or None where it is not known (a scheduler: no KV
    layout). ``link``: a ControlLink to reuse (else one for this call).
    Raises TimeoutError, ValueError (a refusal: another scope, no such file)."""
    own = link is None
    link = ControlLink(endpoint) if own else link
    try:
        found: list[bool] = []
        for start in range(0, len(table_keys), 4096):
            part = table_keys[start : start + 4096]
            message = {"op": "lookup", "file": file, "keys": [k.hex() for k in part]}
            if scope is not None:
                message["scope"] = scope.hex()
            reply, _ = link.request(message, timeout_s)
            if not reply.get("ok"):
                raise ValueError(f"{endpoint}: {reply.get('error')}")
            answer = reply.get("found")
            if not isinstance(answer, list) or len(answer) != len(part):
                raise ValueError(f"{endpoint}: a lookup answer of the wrong length")
            found += [bool(x) for x in answer]
        return found
    finally:
        if own:
            link.close()
