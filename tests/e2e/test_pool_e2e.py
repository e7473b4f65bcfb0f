"""The shared page pool on a real engine: pages written through to a pool
file in /dev/shm come back from it once the host tier no longer holds them,
equal to a plain engine's recompute, and an engine started again on the same
pool file hits at once (its pages outlived the engine). The engine's worker
serves its pool to peers meanwhile: a NIXL agent in this process reads the
pool's slot table out of the worker's memory, as another machine would.
"""

from __future__ import annotations

import time

import pytest

from helpers.system import shm_dir
from helpers.engines import (
    BLOCK_SIZE,
    EVERY_PAGE_LOADED,
    kvbm_counter,
    make_llm,
    random_prompt,
    shutdown,
)
from test_engine_e2e import expected_hit_tokens, generate, reference
from vllm_kvbm.tools.server import free_port, kvbm_transfer_config

pytestmark = pytest.mark.timeout(900)

# 4 MiB pages (float32): 96 MiB holds 22 of them, two sets of 11, so the
# prompt's 10 pages are never evicted by each other.
POOL_SIZE = "96MiB"
PROMPT = random_prompt(10 * BLOCK_SIZE + 40, seed=9101)


@pytest.fixture(scope="module")
def shm():
    with shm_dir("kvbm-e2e-pool-") as d:
        yield d


def pool_config(shm: str, **extra) -> dict:
    return kvbm_transfer_config(
        host_cache_blocks=16, pool_cache_size=POOL_SIZE, pool_dir=shm, **EVERY_PAGE_LOADED, **extra
    )


def pool_file(shm: str) -> tuple[str, bytes]:
    """The pool file's path and its superblock and table, as a view reads them."""
    import glob

    from vllm_kvbm.tiers.pool.layout import Superblock

    (path,) = glob.glob(f"{shm}/kvbm-pool-*-r0of1")
    with open(path, "rb") as f:
        head = f.read(4096)
        sb = Superblock.unpack(head)
        assert sb is not None
        return path, head + f.read(sb.geometry.data_off - 4096)


def pool_pages(shm: str) -> int:
    """Pages the pool file holds (its superblock's count)."""
    from vllm_kvbm.tiers.pool.layout import read_used

    return read_used(pool_file(shm)[1])


def read_table_as_a_peer(endpoint: str, path: str, table: bytes) -> bytes:
    """The pool's superblock and slot table read out of the serving worker's
    memory with one NIXL READ, after its control endpoint's hello."""
    import ctypes
    import mmap
    import os

    from vllm_kvbm.tiers.peer.agent import PeerAgent
    from vllm_kvbm.tiers.peer.control import ControlLink
    from vllm_kvbm.tiers.pool.layout import Superblock

    sb = Superblock.unpack(table)
    link = ControlLink(endpoint)
    agent = PeerAgent("kvbm-test-reader")
    buf = mmap.mmap(-1, len(table))
    cbuf = ctypes.c_char.from_buffer(buf)
    try:
        reply, metadata = link.request(
            {
                "op": "hello",
                "file": os.path.basename(path),
                "scope": sb.scope_digest.hex(),
                "known": ["", -1],
            },
            30,
        )
        assert reply["ok"] and metadata, reply
        assert reply["length"] == sb.geometry.file_bytes == os.path.getsize(path)
        remote = agent.call("add", "add_remote_agent", metadata)
        deadline = time.monotonic() + 30
        while not agent.call("check", "check_remote_metadata", remote):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        reg = agent.register(ctypes.addressof(cbuf), len(table))
        handle = agent.call(
            "xfer",
            "initialize_xfer",
            "READ",
            agent.descs([(ctypes.addressof(cbuf), len(table))]),
            agent.descs([(int(reply["base"]), len(table))]),
            remote,
        )
        state = agent.call("transfer", "transfer", handle)
        while state == "PROC":
            assert time.monotonic() < deadline
            state = agent.call("check", "check_xfer_state", handle)
        assert state == "DONE"
        agent.call("release", "release_xfer_handle", handle)
        agent.deregister(reg)
        return bytes(buf)
    finally:
        link.close()
        del cbuf
        buf.close()


def settle(llm) -> None:
    """Lets the write-through land and a step collect it."""
    time.sleep(1.0)
    generate(llm, [[7] * 8], max_tokens=1)


def test_a_page_gone_from_the_host_tier_comes_back_from_the_pool(shm, plain_llm, model_dir):
    want = reference(plain_llm, [PROMPT])
    pages = len(PROMPT) // BLOCK_SIZE
    port = free_port()
    llm = make_llm(pool_config(shm, pool_serve_port=port, pool_serve_host="127.0.0.1"))
    try:
        first, _ = generate(llm, [PROMPT])  # computed; host tier, then the pool
        settle(llm)
        assert pool_pages(shm) == pages
        path, table = pool_file(shm)
        assert read_table_as_a_peer(f"tcp://127.0.0.1:{port}", path, table) == table
        # the host tier (and vLLM's own cache) forget it: only the pool has it
        assert llm.reset_prefix_cache(reset_connector=True)
        before = kvbm_counter("onboard_blocks_pool")
        got, cached = generate(llm, [PROMPT])
        assert first == want and got == want
        assert cached[0] == expected_hit_tokens(len(PROMPT))
        assert kvbm_counter("onboard_blocks_pool") - before == pages
    finally:
        shutdown(llm)

    # A new engine on the same pool file: the pages are there at once.
    again = make_llm(pool_config(shm))
    try:
        before = kvbm_counter("matched_tokens_pool")
        got, cached = generate(again, [PROMPT])
        assert got == want
        assert cached[0] == expected_hit_tokens(len(PROMPT))
        assert kvbm_counter("matched_tokens_pool") - before == cached[0]
    finally:
        shutdown(again)
