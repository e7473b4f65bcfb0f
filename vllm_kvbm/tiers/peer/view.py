"""A peer's pool as the scheduler sees it: which pages the peer a request's
hint names holds now, asked over its control endpoint (``lookup``: memory
reads of its slot table there; no NIXL in the scheduler process).

Unlike the other views it cannot answer ``contains`` alone (which peer?):
LowerTiers asks ``contains_many_at(endpoint, keys)`` for requests with a
hint (scheduler/router_hints.py), on the lookup thread. A page is held when
every TP rank's pool file at the peer holds it. A peer that does not answer
within ``timeout_s`` is a miss for that question and is not asked again for
``retry_s``, so a dead peer costs one timeout, not one per request.

For a request without a hint, ``locate(keys)`` asks the peer directory
(peer_directory_url, directory.py) which live peer holds the longest run of
its pages, never this engine's own endpoint nor a peer that failed lately;
that peer is then asked as if a hint named it, so a stale entry is a miss.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from vllm_kvbm.keys import PageKey
from vllm_kvbm.tiers.page_names import PageNames
from vllm_kvbm.tiers.peer import protocol
from vllm_kvbm.tiers.pool import layout

if TYPE_CHECKING:
    from vllm_kvbm.config import KVBMConfig
    from vllm_kvbm.engine_info import EngineInfo
    from vllm_kvbm.tiers.peer.control import ControlLink

logger = logging.getLogger(__name__)

# Peers' links kept open at most (least recently used dropped).
_MAX_LINKS = 64


class PeerView:
    name = "peer"

    def __init__(
        self,
        namespace: str,
        page_bytes: int,
        world_size: int,
        secret: bytes | None = None,
        timeout_s: float = 1.0,
        retry_s: float | None = None,
        directory=None,
        own: str | None = None,
    ):
        self._names = PageNames(namespace, page_bytes, secret)
        self._files = [
            layout.file_name(
                layout.name_digest(namespace, page_bytes, r, world_size), r, world_size
            )
            for r in range(world_size)
        ]
        self.timeout_s = timeout_s
        self.retry_s = 4 * timeout_s if retry_s is None else retry_s
        self._links: dict[str, "ControlLink"] = {}
        self._down_until: dict[str, float] = {}
        self._context = None
        self.down = False  # the last question failed (TierCalls reads it)
        # the peer directory's reader (directory.py DirectoryReader; None: none)
        self.directory = directory
        # this engine's own pool endpoint: never asked (set_own)
        self.own = own

    @classmethod
    def from_config(
        cls, config: "KVBMConfig", info: "EngineInfo", secret: bytes | None
    ) -> "PeerView":
        directory = None
        if config.peer_directory_url is not None:
            from vllm_kvbm.tiers.peer.directory import DirectoryReader, config_link

            directory = DirectoryReader(
                config_link(config, "for lookups"),
                layout.file_name(
                    layout.name_digest(
                        info.tier_namespace, info.page_bytes, 0, info.key_namespace.tp_size
                    ),
                    0,
                    info.key_namespace.tp_size,
                ),
            )
        own = None
        if config.pool_serve_port is not None and config.pool_socket is None:
            # what its worker serves on (the workers say so once they run:
            # kvbm-pool's endpoint, or none when the server did not start)
            own = protocol.endpoint_of(config.pool_serve_host, config.pool_serve_port)
        return cls(
            info.tier_namespace,
            info.page_bytes,
            info.key_namespace.tp_size,
            secret,
            timeout_s=config.peer_read_timeout_s,
            directory=directory,
            own=own,
        )

    @property
    def link(self):
        return None  # no standing link to report in the metrics

    def contains(self, key: PageKey) -> bool:
        return False  # which peer: contains_many_at names it

    def contains_many(self, keys: list[PageKey]) -> list[bool]:
        return [False] * len(keys)

    def set_own(self, endpoint: str | None) -> None:
        """This engine's pool is served at ``endpoint`` (None: not served)."""
        self.own = endpoint

    def locate(self, keys: list[PageKey]) -> str | None:
        """The endpoint of the live peer the directory says holds the longest
        run of ``keys`` from the first (None: no directory, none, or it did
        not answer)."""
        if self.directory is None or not keys:
            return None
        now = time.monotonic()
        exclude = {e for e, until in self._down_until.items() if now < until}
        if self.own is not None:
            exclude.add(self.own)
        tkeys = [layout.table_key(self._names, key) for key in keys]
        endpoint = self.directory.locate(tkeys, frozenset(exclude))
        self.down = self.directory.down
        return endpoint

    def contains_many_at(self, endpoint: str, keys: list[PageKey]) -> list[bool]:
        """Which of ``keys`` every TP rank's pool file at ``endpoint`` (the
        peer's rank-0 control endpoint) holds; all False when it cannot say."""
        if not keys:
            return []
        now = time.monotonic()
        if now < self._down_until.get(endpoint, 0.0):
            return [False] * len(keys)
        from vllm_kvbm.tiers.peer.control import peer_lookup

        table_keys = [layout.table_key(self._names, key) for key in keys]
        found = [True] * len(keys)
        try:
            for rank, file in enumerate(self._files):
                todo = [i for i, f in enumerate(found) if f]
                if not todo:
                    break
                rank_ep = protocol.rank_endpoint(endpoint, rank)
                held = peer_lookup(
                    rank_ep,
                    file,
                    None,
                    [table_keys[i] for i in todo],
                    self.timeout_s,
                    link=self._link(rank_ep),
                )
                for i, h in zip(todo, held):
                    found[i] = h
        except Exception as err:  # noqa: BLE001 - a miss, never an error for vLLM
            self._drop(endpoint)
            self._down_until[endpoint] = now + self.retry_s
            self.down = True
            logger.info(
                "KVBM: peer %s did not answer a lookup (%s); its pages are misses for %g s",
                endpoint,
                err,
                self.retry_s,
            )
            return [False] * len(keys)
        self.down = False
        return found

    def _link(self, rank_endpoint: str) -> "ControlLink":
        link = self._links.pop(rank_endpoint, None)
        if link is None:
            import zmq

            from vllm_kvbm.tiers.peer.control import ControlLink

            if self._context is None:
                self._context = zmq.Context()
            link = ControlLink(rank_endpoint, self._context)
        self._links[rank_endpoint] = link  # most recently used last
        while len(self._links) > _MAX_LINKS:
            self._links.pop(next(iter(self._links))).close()
        return link

    def _drop(self, endpoint: str) -> None:
        """A failed peer's links are closed (its queued requests with them)
        and made again when it is next asked."""
        for rank in range(len(self._files)):
            link = self._links.pop(protocol.rank_endpoint(endpoint, rank), None)
            if link is not None:
                link.close()

    def close(self) -> None:
        if self.directory is not None:
            self.directory.close()
        for link in self._links.values():
            link.close()
        self._links = {}
        if self._context is not None:
            self._context.term()
            self._context = None
