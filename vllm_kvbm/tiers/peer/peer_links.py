"""The peer store's peers (part of ``PeerStore``, store.py): each peer's
control link, its ``hello`` (NIXL agent metadata, pool geometry,
incarnation) asked without the store's lock, and its failures (``_down``).
"""

from __future__ import annotations

import itertools
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from vllm_kvbm.tiers.peer import protocol
from vllm_kvbm.tiers.peer.agent import NixlCallError
from vllm_kvbm.tiers.peer.control import ControlLink
from vllm_kvbm.tiers.pool.layout import MAX_WAYS, Geometry

logger = logging.getLogger(__name__)

_generations = itertools.count(1)
_FAILED = -1e9  # hello_at of a peer not answered since it was new or failed (_down)


@dataclass
class _Peer:
    endpoint: str  # this rank's
    link: ControlLink
    generation: int = field(default_factory=lambda: next(_generations))
    remote: str | None = None  # the loaded agent's name
    incarnation: str = ""
    metadata_version: int = -1
    geometry: Geometry | None = None
    base: int = 0
    hello_at: float = _FAILED  # never answered
    used_at: float = field(default_factory=time.monotonic)
    down_until: float = 0.0
    said: str = ""  # the last failure logged
    asking: bool = False  # a hello out, the store's lock let go meanwhile (_hello)
    asking_until: float = 0.0  # its deadline

    def state(self) -> tuple:
        """What a hello's answer is applied to: unchanged while it was out?"""
        return (self.generation, self.incarnation, self.metadata_version, self.down_until)


class _AskAgain(Exception):
    """The peer's state changed while its hello was out: its answer is not
    applied; the next read asks again."""


class PeerLinks:
    """Part of ``PeerStore`` (store.py, which holds the state): its peers."""

    def _ready_peer(self, endpoint: str, deadline: float | None = None) -> _Peer | None:
        """Every read's first step (under the lock): reaped, idle peers forgotten, ``_peer``."""
        self.reap()
        self._forget_idle()
        return self._peer(protocol.rank_endpoint(endpoint, self.rank), deadline)

    def _peer(self, endpoint: str, deadline: float | None = None) -> _Peer | None:
        """The peer at ``endpoint`` (None while down), its due ``hello`` within
        ``deadline`` (monotonic; default: ``read_timeout_s`` from now)."""
        now = time.monotonic()
        peer = self._peers.get(endpoint)
        if peer is None:
            peer = self._peers[endpoint] = _Peer(endpoint, ControlLink(endpoint, self._zmq_context))
        peer.used_at = now
        if now < peer.down_until:
            return None
        if peer.remote is not None and now - peer.hello_at < self.hello_every_s:
            return peer
        end = deadline or now + self.read_timeout_s
        if peer.asking:
            # another thread's hello is out: a peer that answered since its
            # last failure is read as it was meanwhile; else once that answer came
            if peer.remote is None or peer.hello_at <= _FAILED:
                self._turn.wait_for(lambda: not peer.asking, max(0.0, end - now))
            ready = peer.remote is not None and peer.hello_at > _FAILED and not peer.asking
            return peer if ready and not self._closed else None
        try:
            self._hello(peer, end)
            peer.said = ""
            return peer
        except _AskAgain:
            return None
        except (TimeoutError, ValueError, KeyError, TypeError, NixlCallError) as err:
            if deadline is not None and isinstance(err, TimeoutError):
                # a step's short budget, not the peer's fault: asked again next time
                logger.debug("KVBM: peer tier: %s: hello within a step: %s", endpoint, err)
                return None
            self._down(peer, f"{type(err).__name__}: {err}", refused=isinstance(err, ValueError))
            return None

    def _hello(self, peer: _Peer, deadline: float) -> None:
        known = [peer.incarnation, peer.metadata_version]
        message = {"op": "hello", "file": self.file_name, "scope": self.scope.hex(), "known": known}
        before = peer.state()
        # The round trip without the store's lock: a peer slow to answer
        # (stopped, its network gone) holds up neither other peers' reads nor
        # a layered read whose step waits. Only this thread uses the link
        # while ``asking``.
        peer.asking, peer.asking_until = True, deadline
        try:
            with self._unlocked():
                reply, metadata = peer.link.request(message, deadline - time.monotonic())
        finally:
            peer.asking = False
            self._turn.notify_all()
        if self._closed or peer.state() != before:
            raise _AskAgain()  # closed, failed or answered meanwhile
        if not reply.get("ok"):
            raise ValueError(str(reply.get("error")))
        g = Geometry(int(reply["stored_bytes"]), int(reply["nslots"]), int(reply["ways"]))
        if (
            g.stored_bytes != self._codec.stored_bytes
            or not 0 < g.ways <= MAX_WAYS
            or g.nslots % g.ways
            or g.stride != reply["stride"]
            or g.table_off != reply["table_off"]
            or g.data_off != reply["data_off"]
            or int(reply["length"]) < g.file_bytes
        ):
            raise ValueError("the peer's pool file has another page size or layout")
        if [reply["incarnation"], reply["metadata_version"]] != known:
            if metadata is None:
                raise ValueError("the peer sent no NIXL metadata")
            if reply["incarnation"] != peer.incarnation:
                # another process answers at the endpoint: the old one is gone,
                # and so are its transfers (quarantined ones included); a new
                # generation, so nothing of the old one is taken for the new
                if peer.remote is not None:
                    self._unload(peer, gone=True)
                self._live_generations.discard(peer.generation)
                peer.generation = next(_generations)
            elif peer.remote is not None:
                self._unload(peer, gone=False)  # more files registered: new metadata
            name = self._agent.call("add_remote_agent", "add_remote_agent", metadata)
            peer.remote = name.decode() if isinstance(name, bytes) else str(name)
            while not self._agent.call(
                "check_remote_metadata", "check_remote_metadata", peer.remote
            ):
                if time.monotonic() > deadline:
                    raise TimeoutError("the peer's NIXL metadata did not load")
                time.sleep(0.001)
            peer.incarnation = reply["incarnation"]
            peer.metadata_version = reply["metadata_version"]
            self._live_generations.add(peer.generation)
        peer.geometry, peer.base = g, int(reply["base"])
        peer.hello_at = time.monotonic()

    @contextmanager
    def _unlocked(self):
        """The store's lock let go, however deep this thread holds it, and
        taken back: what ``threading.Condition.wait`` does around its wait."""
        state = self._lock._release_save()
        try:
            yield
        finally:
            self._lock._acquire_restore(state)

    def _unload(self, peer: _Peer, gone: bool) -> None:
        """Removes the peer's agent entry; ``gone``: its process is known to
        be gone (its quarantined transfers with it)."""
        if gone:
            self._live_generations.discard(peer.generation)
        try:
            self._agent.call("remove_remote_agent", "remove_remote_agent", peer.remote)
        except NixlCallError as err:
            logger.debug("KVBM: peer tier: %s", err)
        peer.remote = None

    def _gone(self, generation: int) -> bool:
        return generation not in self._live_generations

    def _down(self, peer: _Peer, why: str, refused: bool = False, dead: bool = False) -> None:
        """Not asked again for ``retry_s`` (a refusal: a minute); a peer NIXL
        reports dead is forgotten (its transfers ended)."""
        peer.down_until = time.monotonic() + (60.0 if refused else self.retry_s)
        peer.hello_at = _FAILED
        if peer.said != why:
            peer.said = why
            logger.warning(
                "KVBM: peer tier: %s: %s; its pages are recomputed (asked again in %g s)",
                peer.endpoint,
                why,
                60.0 if refused else self.retry_s,
            )
        if dead:
            if peer.remote is not None:
                self._unload(peer, gone=True)
            self._live_generations.discard(peer.generation)
            peer.incarnation, peer.metadata_version = "", -1

    def _forget_idle(self) -> None:
        now = time.monotonic()
        for endpoint, peer in list(self._peers.items()):
            if now - peer.used_at > self.idle_s and not peer.asking:
                if peer.remote is not None:
                    self._unload(peer, gone=False)
                peer.link.close()
                del self._peers[endpoint]
