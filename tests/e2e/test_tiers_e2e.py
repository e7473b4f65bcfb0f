"""Disk and remote tiers on real engines: onboarding, restart, sharing, faults.

Engine 1 has a tiny host tier, a disk directory and a remote LMCache server.
Pushing a prompt out of its host tier (other prompts fill it) and out of
vLLM's own cache leaves the disk and remote copies, so the next run of that
prompt must come from there. Engine 2 starts later on the same directory and
server: what it finds there was written by engine 1 (restart and sharing).
A cache reset (``reset_prefix_cache(reset_connector=True)``) clears the host
tier; disk and remote pages of the same weights are served again.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from helpers.engines import (
    BLOCK_SIZE,
    EVERY_PAGE_LOADED,
    kvbm_counter,
    make_llm,
    random_prompt,
    shutdown,
    spare_core,
)
from test_engine_e2e import expected_hit_tokens, generate, reference
from vllm_kvbm.tools.server import free_port, kvbm_transfer_config, start_lmcache_server
from vllm_kvbm.tools.server import stop_process as stop

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def remote():
    port = free_port()
    proc = start_lmcache_server(port)
    yield {"port": port, "proc": proc}
    stop(proc)


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kvbm-disk")


# Over the longest prompt (12 blocks), small enough that two short fillers
# push a prompt out of it (clear_engine_and_host).
HOST_BLOCKS = 16


def tier_config(disk_dir: Path, port: int, **extra) -> dict:
    return kvbm_transfer_config(
        host_cache_blocks=HOST_BLOCKS,
        disk_cache_dir=str(disk_dir),
        disk_cache_size="1GiB",
        remote_url=f"lm://127.0.0.1:{port}",
        # a server slowed by the suite's other worker is not
        # what is tested here (a dead one is, below)
        remote_timeout_s=10,
        **{**EVERY_PAGE_LOADED, **extra},
    )


@pytest.fixture(scope="module")
def engine1(model_dir, disk_dir, remote):
    llm = make_llm(tier_config(disk_dir, remote["port"]))
    yield llm
    try:
        shutdown(llm)
    except Exception:  # already shut down by the restart test
        pass


_fillers = iter(range(10_000, 20_000))


def settle(llm) -> None:
    """Lets write-through to disk/remote land and be collected."""
    time.sleep(1.0)
    generate(llm, [[7] * 8], max_tokens=1)  # a step collects the writes' results


def clear_engine_and_host(llm, host_blocks: int = HOST_BLOCKS) -> None:
    """Only the disk and remote tiers keep what was generated before this:
    fresh prompts push it out of the host tier (LRU), then vLLM's own
    prefix cache is cleared (not the connector's: that would be a reset)."""
    settle(llm)
    per_filler = host_blocks // 2 + 2
    for _ in range(2):
        generate(llm, [random_prompt(per_filler * BLOCK_SIZE, seed=next(_fillers))], max_tokens=1)
    settle(llm)
    assert llm.reset_prefix_cache()


PROMPT_DISK = random_prompt(10 * BLOCK_SIZE + 40, seed=9001)
PROMPT_REMOTE = random_prompt(12 * BLOCK_SIZE + 5, seed=9002)
PROMPT_FLIP = random_prompt(6 * BLOCK_SIZE + 3, seed=9003)


def test_onboard_from_disk_equals_recompute(engine1, plain_llm):
    """Where the engine leaves a core free of its OpenMP threads (scripts/
    test.sh's workers), the disk hit is read layer by layer during the step
    that computes the request (worker/layer_reads.py)."""
    want = reference(plain_llm, [PROMPT_DISK])
    generate(engine1, [PROMPT_DISK])  # computes; host, then disk and remote
    clear_engine_and_host(engine1)
    # The reset started a weights epoch: hits stay asynchronous until the
    # worker reported its weights in it (the next steps).
    for i in range(3):
        generate(engine1, [random_prompt(20, seed=6000 + i)], max_tokens=1)
        time.sleep(0.2)
    before = kvbm_counter("onboard_blocks_d2d")
    layered = kvbm_counter("onboard_layered_blocks")
    got, cached = generate(engine1, [PROMPT_DISK])
    assert got == want
    assert cached[0] == expected_hit_tokens(len(PROMPT_DISK))
    assert kvbm_counter("onboard_blocks_d2d") - before == cached[0] // BLOCK_SIZE
    if spare_core():
        assert kvbm_counter("onboard_layered_blocks") - layered == cached[0] // BLOCK_SIZE


def test_corrupt_disk_page_is_recomputed_and_removed(engine1, plain_llm, disk_dir):
    want = reference(plain_llm, [PROMPT_FLIP])
    before = set(disk_dir.glob("*.pt"))
    generate(engine1, [PROMPT_FLIP])
    settle(engine1)
    pages = sorted(set(disk_dir.glob("*.pt")) - before)
    clear_engine_and_host(engine1)
    assert len(pages) == len(PROMPT_FLIP) // BLOCK_SIZE
    victim = pages[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))

    failures = kvbm_counter("checksum_failures")
    got, _ = generate(engine1, [PROMPT_FLIP])
    assert got == want
    assert kvbm_counter("checksum_failures") - failures >= 1
    # Removed; the recomputed block may already have been written through again.
    assert not victim.exists() or victim.read_bytes() != bytes(data)


def test_second_engine_finds_disk_and_remote_pages(engine1, plain_llm, disk_dir, remote, model_dir):
    want = reference(plain_llm, [PROMPT_DISK, PROMPT_REMOTE])
    before = set(disk_dir.glob("*.pt"))
    generate(engine1, [PROMPT_REMOTE])
    settle(engine1)
    new_files = set(disk_dir.glob("*.pt")) - before
    clear_engine_and_host(engine1)
    shutdown(engine1)  # engine 1 exits

    # PROMPT_REMOTE's pages only survive on the server: drop its disk files.
    assert len(new_files) == len(PROMPT_REMOTE) // BLOCK_SIZE
    for path in new_files:
        path.unlink()

    engine2 = make_llm(tier_config(disk_dir, remote["port"]))
    try:
        disk_before = kvbm_counter("matched_tokens_disk")
        remote_before = kvbm_counter("matched_tokens_remote")
        got, cached = generate(engine2, [PROMPT_DISK])
        assert got == [want[0]]
        assert cached[0] == expected_hit_tokens(len(PROMPT_DISK))  # restart: disk hit
        assert kvbm_counter("matched_tokens_disk") - disk_before == cached[0]

        got, cached = generate(engine2, [PROMPT_REMOTE])
        assert got == [want[1]]
        assert cached[0] == expected_hit_tokens(len(PROMPT_REMOTE))  # shared via the server
        assert kvbm_counter("matched_tokens_remote") - remote_before == cached[0]

        # A connector reset clears the host tier; the weights did not change,
        # so the disk and remote pages are served again (keys name the
        # weights, not the reset).
        on_disk = set(disk_dir.glob("*.pt"))
        assert engine2.reset_prefix_cache(reset_connector=True)
        matched = kvbm_counter("matched_tokens")
        got, cached = generate(engine2, [PROMPT_DISK, PROMPT_REMOTE])
        assert got == want
        assert cached == [
            expected_hit_tokens(len(PROMPT_DISK)),
            expected_hit_tokens(len(PROMPT_REMOTE)),
        ]
        assert kvbm_counter("matched_tokens") - matched == sum(cached)
        assert on_disk <= set(disk_dir.glob("*.pt"))

        # The server dies: lookups and writes fail fast, outputs stay right.
        stop(remote["proc"])
        prompt = random_prompt(5 * BLOCK_SIZE, seed=9004)
        want_new = reference(plain_llm, [prompt])
        start = time.monotonic()
        got, _ = generate(engine2, [prompt])
        clear_engine_and_host(engine2)
        got_again, _ = generate(engine2, [prompt])  # from disk; remote is gone
        assert got == got_again == want_new
        assert time.monotonic() - start < 120
    finally:
        shutdown(engine2)
