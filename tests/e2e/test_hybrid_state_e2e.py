"""A Qwen3-Next-shaped hybrid (three Gated DeltaNet layers, then a
full-attention layer; bf16, the only dtype vLLM's CPU build runs GDN in)
with vLLM's hybrid allocator (HMA) on, served by KVBM group by group
(scheduler/group_pages.py): a hit ends where vLLM kept the recurrent state
(align mode) and loads that state with the prefix's attention KV.
Greedy outputs with KV onboarded from the host tier, the disk tier and Redis
(a second engine), in a batch and across a growing conversation, equal those
of a plain engine (HMA on) that computed the same tokens from the same
prefix: in bf16 a prompt computed whole rounds otherwise than its tail
computed over a cached prefix (vLLM's own cache changes near-tie tokens the
same way), so the reference is the plain engine serving the prefix from its
own cache, at the same boundary (asserted): the loaded KV and state must be
exactly what it computed. The model is built locally (tools/local_model),
tiny and random.
"""

from __future__ import annotations

import pytest

from helpers import ROOT
from helpers.engines import EVERY_PAGE_LOADED, kvbm_counter, make_llm, random_prompt, shutdown
from test_bf16_e2e import same_binding  # noqa: F401 (a fixture: both engines on the same cores)
from test_engine_e2e import generate
from test_redis_e2e import password_file, redis_server  # noqa: F401 (fixtures)
from test_hybrid_window_e2e import hits_from_host_then_disk
from test_tiers_e2e import settle
from vllm_kvbm.tools.local_model_archs import HYBRID_DIR, build_qwen3_next
from vllm_kvbm.tools.server import kvbm_transfer_config

pytestmark = pytest.mark.timeout(1200)


# ---- Qwen3-Next: Gated DeltaNet state --------------------------------------------

# One request a step: in bf16 a request's tokens depend on what shares its
# step, and KVBM's loads finish at their own pace, so a batch would be
# scheduled otherwise on the two engines.
GDN_ENGINE = dict(
    dtype="bfloat16",
    max_model_len=4096,
    max_num_batched_tokens=1024,
    max_num_seqs=1,
    kv_cache_memory_bytes=512 << 20,
    block_size=None,
)  # vLLM picks the block size, big enough for a page to hold a GDN state: 128 on
# an AVX2 CPU, 256 on an Intel Xeon with AVX-512 and AMX
GDN_LENGTHS = (300, 700, 1100, 2100)


def gdn_hit(length: int, block: int) -> int:
    """Where vLLM's prefix cache keeps a prompt's state: at its replay
    boundary, its last full block before its last token
    (--prefix-cache-retention-interval 0, the default); KVBM stores the state
    vLLM hands off there. 128-token blocks: 300 -> 256, 700 -> 640,
    1100 -> 1024, 2100 -> 2048."""
    return (length - 1) // block * block


def assert_at_replay_boundaries(hits: list[int], lengths, block: int) -> None:
    """vLLM's own cache hit each prompt at its replay boundary. At 128-token
    blocks, every one; at 256 (vLLM's pick on an Intel Xeon with AMX) vLLM may keep no state
    for a prompt on its first pass (seen for 700 and 760 tokens: a miss on
    the first repeat, a hit at 512 on the second), so one prompt may miss."""
    expected = [gdn_hit(n, block) for n in lengths]
    if block == 128:
        assert hits == expected
    else:
        assert all(h in (0, e) for h, e in zip(hits, expected)), (hits, expected)
        assert sum(h == e for h, e in zip(hits, expected)) >= len(expected) - 1, hits


def block_size(llm) -> int:
    return llm.llm_engine.vllm_config.cache_config.block_size


# every page of the four prompts at 128-token blocks: 2 + 5 + 8 + 16 attention
# pages, and each of the three GDN groups' state at each prompt's replay
# boundary (12)
GDN_HOST_BLOCKS = 48


@pytest.fixture(scope="module")
def qwen3_next():
    return str(build_qwen3_next(ROOT / HYBRID_DIR))


@pytest.fixture(scope="module")
def plain_gdn(qwen3_next, same_binding):  # noqa: F811
    llm = make_llm(None, model=qwen3_next, **GDN_ENGINE)
    yield llm
    shutdown(llm)


def gdn_config(disk_dir, redis, password) -> dict:
    tiers = dict(disk_cache_dir=str(disk_dir), disk_cache_size="256MiB") if disk_dir else {}
    if redis is not None:
        tiers.update(remote_url=redis.url, remote_password_file=str(password), remote_timeout_s=10)
    return kvbm_transfer_config(host_cache_blocks=GDN_HOST_BLOCKS, **tiers, **EVERY_PAGE_LOADED)


@pytest.fixture(scope="module")
def kvbm_gdn(
    qwen3_next,
    same_binding,
    tmp_path_factory,
    redis_server,  # noqa: F811
    password_file,
):  # noqa: F811
    llm = make_llm(
        gdn_config(tmp_path_factory.mktemp("disk"), redis_server, password_file),
        model=qwen3_next,
        **GDN_ENGINE,
    )
    yield llm
    try:
        shutdown(llm)
    except Exception:  # already shut down by the Redis test
        pass


def from_own_cache(plain, prompts):
    """The plain engine's outputs and hits for ``prompts`` served from its
    own prefix cache (computed once first, alone, as KVBM's engine stores them)."""
    assert plain.reset_prefix_cache()
    for p in prompts:
        generate(plain, [p])
    return generate(plain, prompts)


def test_gdn_hybrid_hits_from_host_and_disk_equal_the_plain_engines(plain_gdn, kvbm_gdn):
    # vLLM kept its hybrid allocator on (without SupportsHMA this model stops at startup)
    assert kvbm_gdn.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
    prompts = [random_prompt(n, seed=9700 + n) for n in GDN_LENGTHS]
    block = block_size(plain_gdn)
    assert block_size(kvbm_gdn) == block
    want, hits = from_own_cache(plain_gdn, prompts)
    assert_at_replay_boundaries(hits, GDN_LENGTHS, block)
    for p in prompts:
        generate(kvbm_gdn, [p])

    # KVBM hits where vLLM's own cache does; from disk once 3000-token
    # fillers (their pages and three states each) outnumber the host slots
    # twice (with a margin of one filler, one page stayed in the host tier
    # once on a loaded machine)
    fillers = max(3, 2 * GDN_HOST_BLOCKS // (3000 // block + 3))
    hits_from_host_then_disk(kvbm_gdn, prompts, want, hits, fillers)


def test_gdn_hybrid_growing_conversation_equals_the_plain_engines(plain_gdn, kvbm_gdn):
    """Each turn sends the last turn's prompt and answer and a new message;
    the plain engine keeps its own cache across turns, KVBM's engine loses
    its own before each: both resume at the last prompt's last full block
    (no answer crosses a block boundary of 128 or 256 tokens: 1100, 1616,
    2132 tokens)."""
    assert plain_gdn.reset_prefix_cache()
    conversation = random_prompt(1100, seed=9801)
    previous = 0  # the length of the last turn's prompt
    for turn in range(3):
        want, own = generate(plain_gdn, [conversation])
        assert kvbm_gdn.reset_prefix_cache()
        got, cached = generate(kvbm_gdn, [conversation])
        assert got == want and cached == own
        if turn:  # the last prompt's state, at its last full block
            block = block_size(kvbm_gdn)
            assert cached[0] == previous // block * block
        previous = len(conversation)
        conversation = conversation + want[0] + random_prompt(500, seed=9810 + turn)


def test_gdn_hybrid_second_engine_hits_from_redis_equal_the_plain_engines(
    plain_gdn, kvbm_gdn, qwen3_next, redis_server, password_file
):  # noqa: F811
    """The first engine wrote its pages through to Redis; a second engine
    with Redis as its only lower tier loads them."""
    prompts = [random_prompt(n, seed=9900 + n) for n in (1100, 2100)]
    want, hits = from_own_cache(plain_gdn, prompts)
    assert_at_replay_boundaries(hits, (1100, 2100), block_size(plain_gdn))
    for p in prompts:
        generate(kvbm_gdn, [p])
    settle(kvbm_gdn)
    shutdown(kvbm_gdn)
    second = make_llm(gdn_config(None, redis_server, password_file), model=qwen3_next, **GDN_ENGINE)
    try:
        remote = kvbm_counter("matched_tokens_remote")
        got, cached = generate(second, prompts)
        assert got == want and cached == hits
        assert kvbm_counter("matched_tokens_remote") - remote == sum(hits)
    finally:
        shutdown(second)
