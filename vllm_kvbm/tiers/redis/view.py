"""A Redis/Valkey remote tier as the scheduler sees it: EXISTS, pipelined."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_kvbm.config import parse_remote_url
from vllm_kvbm.keys import PageKey
from vllm_kvbm.tiers.base import TierView
from vllm_kvbm.tiers.page_names import page_namer
from vllm_kvbm.tiers.redis.connection import OnRedisLink, RedisLink

if TYPE_CHECKING:
    from vllm_kvbm.config import KVBMConfig
    from vllm_kvbm.engine_info import EngineInfo


class RedisView(OnRedisLink, TierView):
    """EXISTS on every TP rank's page, in one pipelined round trip.

    A page exists only if all ranks' pages do (an LRU server evicts them one
    by one). The call that finds the server dead or frozen waits at most
    ``timeout_s`` per socket operation; after it lookups miss at once while
    the link is re-made in the background, on a jittered backoff from
    ``retry_interval_s`` (the scheduler thread never waits on a reconnect).
    A refused password at startup is a KVBMConfigError naming the key.
    """

    name = "remote"

    def __init__(
        self,
        url: str,
        password,
        namespace: str,
        page_bytes: int,
        world_size: int,
        timeout_s: float = 2.0,
        retry_interval_s: float = 2.0,
        tls_ca_file: str | None = None,
        secret: bytes | None = None,
    ):
        self.url = url
        self._names = [
            page_namer(namespace, page_bytes, rank, world_size, secret)
            for rank in range(world_size)
        ]
        self._link = RedisLink(
            parse_remote_url("remote_url", url),
            password,
            timeout_s,
            retry_interval_s,
            "for lookups",
            tls_ca_file,
        )

    @classmethod
    def from_config(
        cls, config: "KVBMConfig", info: "EngineInfo", secret: bytes | None
    ) -> "RedisView":
        return cls(
            config.remote_url,
            config.remote_password,
            info.tier_namespace,
            info.page_bytes,
            info.key_namespace.tp_size,
            config.remote_timeout_s,
            tls_ca_file=config.remote_tls_ca_file,
            secret=secret,
        )

    def contains(self, key: PageKey) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: list[PageKey]) -> list[bool]:
        if not keys:
            return []
        names = [name(key) for key in keys for name in self._names]

        def exists(client):
            pipe = client.pipeline(transaction=False)
            for n in names:
                pipe.exists(n)
            return pipe.execute()

        found = self._link.call(exists, None, "lookup")
        if found is None:
            return [False] * len(keys)
        ranks = len(self._names)
        return [all(found[i * ranks : (i + 1) * ranks]) for i in range(len(keys))]

    def close(self) -> None:
        self._link.close()
