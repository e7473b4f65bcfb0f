"""Tensor parallelism (TP=2) on real engines: each rank moves its own shard.

A plain TP=2 engine computes every prompt itself; a KVBM TP=2 engine with a
host and a disk tier must give the same greedy tokens when the prefix comes
back from the host tier, from the disk tier, and when one rank's disk page is
corrupt (that rank's load fails, the other's succeeds: vLLM must recompute,
never combine a good shard with a bad one). vLLM CPU runs TP=2 with one core
per rank (VLLM_CPU_OMP_THREADS_BIND='0|1'), both engines bound alike.
"""

from __future__ import annotations

import os

import pytest

from helpers.engines import (
    BLOCK_SIZE,
    EVERY_PAGE_LOADED,
    kvbm_counter,
    make_llm,
    random_prompt,
    shutdown,
)
from test_engine_e2e import expected_hit_tokens, generate
from test_tiers_e2e import clear_engine_and_host, settle
from vllm_kvbm.tools.server import kvbm_transfer_config

pytestmark = pytest.mark.timeout(1200)

TP = 2
HOST_BLOCKS = 24
ENGINE = dict(
    tensor_parallel_size=TP,
    kv_cache_memory_bytes=256 << 20,
    max_model_len=4096,
    max_num_batched_tokens=4096,
)


@pytest.fixture(scope="module")
def tp_env():
    saved = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    yield
    if saved is None:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    else:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = saved


PROMPTS = {
    name: random_prompt(n, seed=seed)
    for name, n, seed in (
        ("host", 6 * BLOCK_SIZE + 17, 7001),
        ("disk", 8 * BLOCK_SIZE + 3, 7002),
        ("bad_rank", 7 * BLOCK_SIZE + 9, 7003),
        ("swapped", 8 * BLOCK_SIZE + 52, 7004),
    )
}


@pytest.fixture(scope="module")
def want(model_dir, tp_env):
    """Greedy tokens of a plain TP=2 engine that computes every prompt."""
    llm = make_llm(None, **ENGINE)
    try:
        return {name: generate(llm, [p])[0][0] for name, p in PROMPTS.items()}
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def tp_kvbm(model_dir, tp_env, want, tmp_path_factory):
    """Pages sealed under a deployment secret (the swapped-pages test)."""
    disk = tmp_path_factory.mktemp("kvbm-tp-disk")
    secret_file = tmp_path_factory.mktemp("kvbm-tp-secret") / "page.secret"
    secret_file.write_bytes(os.urandom(32))
    secret_file.chmod(0o600)
    llm = make_llm(
        kvbm_transfer_config(
            host_cache_blocks=HOST_BLOCKS,
            disk_cache_dir=str(disk),
            disk_cache_size="512MiB",
            page_secret_file=str(secret_file),
            **EVERY_PAGE_LOADED,
        ),
        **ENGINE,
    )
    yield llm, disk
    shutdown(llm)


def test_tp2_host_tier_hit_equals_recompute(tp_kvbm, want):
    llm, _ = tp_kvbm
    prompt = PROMPTS["host"]
    assert generate(llm, [prompt])[0][0] == want["host"]
    settle(llm)
    assert llm.reset_prefix_cache()
    before = kvbm_counter("onboard_blocks_h2d")
    got, cached = generate(llm, [prompt])
    assert got[0] == want["host"]
    assert cached[0] == expected_hit_tokens(len(prompt))
    assert kvbm_counter("onboard_blocks_h2d") - before == cached[0] // BLOCK_SIZE


def test_tp2_disk_tier_hit_equals_recompute(tp_kvbm, want):
    llm, disk = tp_kvbm
    prompt = PROMPTS["disk"]
    before_files = set(disk.glob("*.pt"))
    written_before = kvbm_counter("offload_blocks_h2d")
    assert generate(llm, [prompt])[0][0] == want["disk"]
    settle(llm)
    new = set(disk.glob("*.pt")) - before_files
    blocks = len(prompt) // BLOCK_SIZE
    # one page per block and rank, counted once per block (not per rank)
    assert len([p for p in new if f"@{TP}@0@" in p.name]) == blocks
    assert len([p for p in new if f"@{TP}@1@" in p.name]) == blocks
    assert kvbm_counter("offload_blocks_h2d") - written_before == blocks
    clear_engine_and_host(llm, HOST_BLOCKS)
    before = kvbm_counter("matched_tokens_disk")
    got, cached = generate(llm, [prompt])
    assert got[0] == want["disk"]
    assert cached[0] == expected_hit_tokens(len(prompt))
    assert kvbm_counter("matched_tokens_disk") - before == cached[0]


def test_tp2_one_rank_fails_its_load_and_vllm_recomputes(tp_kvbm, want):
    llm, disk = tp_kvbm
    prompt = PROMPTS["bad_rank"]
    before_files = set(disk.glob("*.pt"))
    assert generate(llm, [prompt])[0][0] == want["bad_rank"]
    settle(llm)
    rank1 = sorted(p for p in set(disk.glob("*.pt")) - before_files if f"@{TP}@1@" in p.name)
    assert len(rank1) == len(prompt) // BLOCK_SIZE
    clear_engine_and_host(llm, HOST_BLOCKS)
    for page in rank1:  # every rank-1 page of this prompt: rank 0's stay good
        data = bytearray(page.read_bytes())
        data[len(data) // 2] ^= 0xFF
        page.write_bytes(bytes(data))
    errors, checksums = kvbm_counter("load_error_blocks"), kvbm_counter("checksum_failures")
    got, _ = generate(llm, [prompt])
    assert got[0] == want["bad_rank"]
    assert kvbm_counter("checksum_failures") > checksums
    assert kvbm_counter("load_error_blocks") > errors
    # Whatever the host tier now holds for this prompt (the recomputed KV,
    # never the failed load's slots) serves the next run correctly.
    settle(llm)
    assert llm.reset_prefix_cache()
    got, cached = generate(llm, [prompt])
    assert got[0] == want["bad_rank"] and cached[0] == expected_hit_tokens(len(prompt))


def test_tp2_rank_pages_swapped_without_the_secret_are_refused(tp_kvbm, want):
    """Someone who can write the disk directory but holds no page secret swaps
    each rank-0 page file with its rank-1 twin (the names differ only in the
    rank). Every page is still intact and sealed under the deployment's
    secret, but each is bound to the rank that wrote it: each rank refuses
    the page it reads (counted) and vLLM recomputes."""
    llm, disk = tp_kvbm
    prompt = PROMPTS["swapped"]
    n_pages = len(prompt) // BLOCK_SIZE
    before_files = set(disk.glob("*.pt"))
    assert generate(llm, [prompt])[0][0] == want["swapped"]
    settle(llm)
    rank0 = sorted(p for p in set(disk.glob("*.pt")) - before_files if f"@{TP}@0@" in p.name)
    assert len(rank0) == n_pages
    clear_engine_and_host(llm, HOST_BLOCKS)
    for page in rank0:
        twin = page.with_name(page.name.replace(f"@{TP}@0@", f"@{TP}@1@"))
        a, b = page.read_bytes(), twin.read_bytes()
        assert a != b
        page.write_bytes(b)
        twin.write_bytes(a)

    auth, checksum = kvbm_counter("page_auth_failures"), kvbm_counter("checksum_failures")
    d2d, errors = kvbm_counter("onboard_blocks_d2d"), kvbm_counter("load_error_blocks")
    got, _ = generate(llm, [prompt])
    assert got[0] == want["swapped"]
    refused = (
        kvbm_counter("page_auth_failures") - auth + kvbm_counter("checksum_failures") - checksum
    )
    assert refused >= n_pages  # each rank refuses every page it read
    assert kvbm_counter("load_error_blocks") - errors > 0
    assert kvbm_counter("onboard_blocks_d2d") == d2d
    # Refused pages are removed; the recomputed KV is written again and then
    # serves the prompt from disk.
    settle(llm)
    clear_engine_and_host(llm, HOST_BLOCKS)
    got, cached = generate(llm, [prompt])
    assert got[0] == want["swapped"]
    assert cached[0] == expected_hit_tokens(len(prompt))
