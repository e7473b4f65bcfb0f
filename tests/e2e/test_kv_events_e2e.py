"""KV events for routers from a real `vllm serve`: a ZMQ SUB socket, as
Dynamo's router or llm-d's indexer would subscribe, decoding vLLM's own
msgpack types, sees the host tier's pages stored and evicted (medium CPU) as
the connector counts them on /metrics, named as vLLM names the same blocks."""

from __future__ import annotations

import json
import time

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from helpers.engines import random_prompt
from vllm_kvbm.tools.server import kvbm_transfer_config, vllm_server

pytestmark = pytest.mark.timeout(900)

BLOCK = 128
SERVE_ARGS = [
    "--enforce-eager",
    "--max-model-len",
    "2048",
    "--gpu-memory-utilization",
    "0.25",
    "--num-gpu-blocks-override",
    "32",
    "--block-size",
    str(BLOCK),
]


class Subscriber:
    """A router's side of vLLM's event stream: every batch, decoded."""

    def __init__(self, endpoint: str):
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(endpoint)  # before vLLM binds: zmq connects when it does
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.events: list = []

    def drain(self, wait_ms: int = 200) -> None:
        while self.socket.poll(wait_ms):
            _topic, _seq, payload = self.socket.recv_multipart()
            self.events += self.decoder.decode(payload).events

    def hashes(self, kind, medium: str) -> list:
        return [
            h
            for e in self.events
            if isinstance(e, kind) and e.medium == medium
            for h in e.block_hashes
        ]

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


def test_host_tier_events_match_the_connector_counters(model_dir, tmp_path):
    # vLLM's PUB binds an ipc:// (or tcp://*) endpoint and connects to any
    # other. ipc: nothing reachable from outside this machine. (With a
    # tcp://127.0.0.1 endpoint vLLM connects to a SUB that binds; here such a
    # SUB never got a message, its subscription not reaching the PUB.)
    endpoint = f"ipc://{tmp_path}/kv-events"
    events_config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
    sub = Subscriber(endpoint)
    # Three prompts of three full blocks into a host tier of four: five evictions.
    prompts = [random_prompt(3 * BLOCK + 10, seed) for seed in (231, 232, 233)]
    try:
        with vllm_server(
            str(model_dir),
            kvbm_transfer_config(host_cache_blocks=4),
            SERVE_ARGS + ["--kv-events-config", json.dumps(events_config)],
            startup_timeout=600,
        ) as server:
            time.sleep(1)  # our SUB socket's connection to vLLM's PUB settles
            for prompt in prompts:
                _, _, text = server.stream_completion(prompt, max_tokens=2)
                assert text
            deadline = time.monotonic() + 120
            while True:
                sub.drain()
                stored = sub.hashes(BlockStored, "CPU")
                removed = sub.hashes(BlockRemoved, "CPU")
                offloaded = server.metric("kvbm_offload_blocks_total")
                evicted = server.metric("kvbm_evicted_blocks_total")
                if offloaded == 9 and evicted == 5 and (len(stored), len(removed)) == (9, 5):
                    break
                assert time.monotonic() < deadline, (
                    f"events: {len(stored)} stored, {len(removed)} removed (medium CPU); "
                    f"counters: {offloaded} offloaded, {evicted} evicted"
                )
    finally:
        sub.close()
    # vLLM's own events name the same blocks (medium GPU): a router that
    # hashes prompts as vLLM does matches KVBM's pages.
    gpu = sub.hashes(BlockStored, "GPU")
    assert set(stored) <= set(gpu) and len(set(stored)) == 9
    # each prompt's three blocks, in order, with their tokens
    cpu_events = [e for e in sub.events if isinstance(e, BlockStored) and e.medium == "CPU"]
    tokens = [t for e in cpu_events for t in e.token_ids]
    assert tokens == [t for prompt in prompts for t in prompt[: 3 * BLOCK]]
    assert all(e.block_size == BLOCK for e in cpu_events)
    # LRU: the first prompt's three blocks, then the second's first two
    assert removed == stored[:5]
