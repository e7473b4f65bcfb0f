"""bfloat16 on every CPU: KV onboarded from the host tier, the disk tier and
Redis gives the outputs of a plain bf16 engine.

The other engine tests run float32 (tests/helpers/engines.py), the dtype
that fits a CPU without native bf16; real models ship in bf16, so these few
cases run it everywhere, slowly where bf16 is emulated (short prompts).

The reference is a plain bf16 engine that finds the same prefix in its own
prefix cache: in bf16, attention over cached KV rounds differently from a
full recompute, and what is under test is that the bytes KVBM onboards are
the bytes vLLM cached. Both engines run the same OpenMP binding, since the
thread count changes the order of bf16 reductions.
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
from test_redis_store import PASSWORD, RedisServer
from test_tiers_e2e import clear_engine_and_host
from vllm_kvbm.tools.server import kvbm_transfer_config

pytestmark = pytest.mark.timeout(1200)

HOST_BLOCKS = 4
BF16 = dict(
    dtype="bfloat16",
    max_model_len=2048,
    max_num_batched_tokens=2048,
    kv_cache_memory_bytes=256 << 20,
)
# two full blocks and a partial one: short, since bf16 may be emulated
LENGTH = 2 * BLOCK_SIZE + 17


@pytest.fixture(scope="module")
def same_binding():
    """Both engines on the same cores (vLLM gives a connector's engine one
    core fewer in reserve otherwise)."""
    old = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{max(0, len(os.sched_getaffinity(0)) - 1)}"
    yield
    if old is None:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    else:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = old


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    srv = RedisServer(tmp_path_factory.mktemp("redis-bf16"), PASSWORD, "256mb").start()
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kvbm-disk-bf16")


@pytest.fixture(scope="module")
def plain_bf16(model_dir, same_binding):
    llm = make_llm(None, **BF16)
    yield llm
    shutdown(llm)


def _password_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("secret-bf16") / "redis-password"
    path.write_text(PASSWORD + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def kvbm(model_dir, same_binding, disk_dir, redis_server, tmp_path_factory):
    """Host, disk and Redis tiers in one engine (one start for every case): a
    prompt stored to every tier comes back from disk, the lower tier looked up
    first; one stored to the host tier and Redis only (kv_store_tiers) comes
    back from Redis."""
    config = kvbm_transfer_config(
        host_cache_blocks=HOST_BLOCKS,
        disk_cache_dir=str(disk_dir),
        disk_cache_size="256MiB",
        remote_url=redis_server.url,
        remote_password_file=str(_password_file(tmp_path_factory)),
        remote_timeout_s=2,
        **EVERY_PAGE_LOADED,
    )
    llm = make_llm(config, **BF16)
    yield llm
    shutdown(llm)


def cached_reference(plain, prompt):
    """The plain engine's output with the prompt's full blocks in its own
    prefix cache (the first run computes them, the second hits them)."""
    plain.reset_prefix_cache()
    generate(plain, [prompt])
    got, cached = generate(plain, [prompt])
    assert cached[0] == expected_hit_tokens(len(prompt))
    return got


def test_bf16_engine_runs_bf16(kvbm):
    assert str(kvbm.llm_engine.vllm_config.model_config.dtype) == "torch.bfloat16"


def test_bf16_onboard_from_host(kvbm, plain_bf16):
    prompt = random_prompt(LENGTH, seed=27001)
    want = cached_reference(plain_bf16, prompt)
    generate(kvbm, [prompt])
    kvbm.reset_prefix_cache()  # vLLM's own cache only: the host tier keeps it
    before = kvbm_counter("onboard_blocks_h2d")
    got, cached = generate(kvbm, [prompt])
    assert got == want
    assert cached[0] == expected_hit_tokens(LENGTH)
    assert kvbm_counter("onboard_blocks_h2d") - before == cached[0] // BLOCK_SIZE


def stored_to(llm, prompt, tiers: list[str] | None) -> None:
    """Computes ``prompt`` and stores it to the host tier and ``tiers`` (every
    tier: None)."""
    from vllm import SamplingParams

    extra = None if tiers is None else {"kv_transfer_params": {"kv_store_tiers": tiers}}
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, extra_args=extra)
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)


@pytest.mark.parametrize(
    "tier,store_tiers,counter",
    [
        ("disk", None, "onboard_blocks_d2d"),
        ("redis", ["host", "remote"], "onboard_blocks_remote"),
    ],
    ids=["disk", "redis"],
)
def test_bf16_onboard_from_a_lower_tier(tier, store_tiers, counter, kvbm, plain_bf16):
    prompt = random_prompt(LENGTH, seed=27002 if tier == "disk" else 27003)
    want = cached_reference(plain_bf16, prompt)
    stored_to(kvbm, prompt, store_tiers)
    clear_engine_and_host(kvbm, HOST_BLOCKS)  # only the lower tier keeps the prompt
    before = kvbm_counter(counter)
    got, cached = generate(kvbm, [prompt])
    assert got == want
    assert cached[0] == expected_hit_tokens(LENGTH)
    assert kvbm_counter(counter) - before == cached[0] // BLOCK_SIZE
