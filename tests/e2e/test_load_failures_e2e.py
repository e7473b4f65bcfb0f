"""Every way a load can fail is a recompute, on a dense model and on a hybrid
one, and the engine goes on serving.

A hybrid model (here Gemma 3-shaped: sliding-window and full-attention
layers, vLLM's hybrid allocator on) has several KV cache groups; vLLM stops
the engine if a connector reports failed block ids for one, so KVBM reports
the request as failed (``failed_recving``) and vLLM recomputes it whole. A
dense model's failed blocks are reported as block ids, as vLLM recomputes
them from the first.

Each failure is produced for real on a hit whose pages only one lower tier
still holds (the host tier and vLLM's own cache emptied first): a corrupt page
file on disk; a page on Redis moved under another page's name (sealed under
the page secret: it does not open there); the pages evicted from Redis, the
read stalled past the tier's timeout, and the server killed, each at the
moment the worker sends its first GET (a relay in front of Redis runs the
fault then). Greedy outputs equal those of a plain engine that recomputed
the prompt. The refused load (vLLM allocated blocks the lookup did not plan
for) cannot be produced through vLLM's public API: tests/unit/test_hybrid_models.py
and test_worker_unit.py take it through vLLM's real scheduler and the real worker.
"""

from __future__ import annotations

import time

import pytest

from helpers import ROOT
from helpers.engines import (
    EVERY_PAGE_LOADED,
    generate_request,
    kvbm_counter,
    make_llm,
    random_prompt,
    shutdown,
)
from helpers.read_fault_relay import ReadFaultRelay
from test_bf16_e2e import same_binding  # noqa: F401 (a fixture: both engines on the same cores)
from test_hybrid_window_e2e import recomputed
from test_redis_e2e import page_keys
from test_redis_store import PASSWORD, RedisServer
from test_tiers_e2e import settle
from vllm_kvbm.tiers.page_format import HEADER_BYTES
from vllm_kvbm.tools import local_model_archs
from vllm_kvbm.tools.server import kvbm_transfer_config

pytestmark = pytest.mark.timeout(1500)

REMOTE_TIMEOUT_S = 1.0
LENGTH = 1001  # 7 full pages of 128 tokens: a hit of 896
# A host tier that holds a prompt's pages, and one filler longer than it (27
# pages): every prefill of a filler is seconds of the test.
HOST_BLOCKS = 24
FILLER = 3500
# Both models with 128-token blocks and a context the fillers fit in.
ENGINE = dict(max_model_len=4096, max_num_batched_tokens=4096)
MODELS = {
    "dense": lambda: None,  # the suite's Llama (helpers.engines.MODEL_DIR)
    "hybrid": lambda: str(local_model_archs.build_gemma3(ROOT / local_model_archs.GEMMA3_DIR)),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    path = MODELS[request.param]()
    return request.param, ({} if path is None else {"model": path})


@pytest.fixture(scope="module")
def redis_server(model, tmp_path_factory):
    srv = RedisServer(tmp_path_factory.mktemp("redis"), PASSWORD, "2gb", "allkeys-lru").start()
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def relay(redis_server):
    r = ReadFaultRelay(redis_server.port)
    yield r
    r.close()


@pytest.fixture(scope="module")
def disk_dir(model, tmp_path_factory):
    return tmp_path_factory.mktemp("disk")


@pytest.fixture(scope="module")
def kvbm(model, same_binding, relay, disk_dir, tmp_path_factory):  # noqa: F811
    secrets = tmp_path_factory.mktemp("secrets")
    (secrets / "redis-password").write_text(PASSWORD + "\n")
    (secrets / "page-secret").write_bytes(b"k" * 32)
    for f in secrets.iterdir():
        f.chmod(0o600)
    config = kvbm_transfer_config(
        host_cache_blocks=HOST_BLOCKS,
        disk_cache_dir=str(disk_dir),
        disk_cache_size="2GiB",
        remote_url=f"redis://127.0.0.1:{relay.port}",
        remote_password_file=str(secrets / "redis-password"),
        remote_timeout_s=REMOTE_TIMEOUT_S,
        page_secret_file=str(secrets / "page-secret"),
        **EVERY_PAGE_LOADED,
    )
    llm = make_llm(config, **model[1], **ENGINE)
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def plain(model, same_binding):  # noqa: F811
    llm = make_llm(None, **model[1], **ENGINE)
    yield llm
    shutdown(llm)


def only_lower_tiers_keep(llm) -> None:
    """A fresh prompt stored in the host tier only pushes every page out of
    it (LRU: more pages than HOST_BLOCKS), then vLLM's own prefix cache is
    cleared: only the disk and Redis keep what was stored before, and they
    hold nothing of the filler."""
    settle(llm)
    generate_request(
        llm,
        {"prompt_token_ids": random_prompt(FILLER, seed=next(_fillers))},
        {"kv_store_tiers": ["host"]},
        max_tokens=1,
    )
    settle(llm)
    assert llm.reset_prefix_cache()


_fillers = iter(range(99000, 100000))


def stored_only_below(llm, plain, seed: int, tier: str) -> tuple[list[int], list[int]]:
    """A prompt computed and stored in the host tier and ``tier`` only, then
    pushed out of the host tier and vLLM's own cache: (prompt, the plain
    engine's greedy output)."""
    prompt = random_prompt(LENGTH, seed=seed)
    want = recomputed(plain, [prompt])[0]
    out = generate_request(llm, {"prompt_token_ids": prompt}, {"kv_store_tiers": ["host", tier]})
    assert list(out.outputs[0].token_ids) == want
    only_lower_tiers_keep(llm)
    return prompt, want


def failed_then_recomputed(llm, prompt, want, tier: str, counter: str) -> None:
    """The prompt loaded from ``tier`` only (its lookup finds it there), the
    load fails: the output is the recompute's, and the failure is counted."""
    errors, failures = kvbm_counter("load_error_blocks"), kvbm_counter(f"{counter}@{tier}")
    out = generate_request(llm, {"prompt_token_ids": prompt}, {"kv_load_tiers": [tier]})
    assert list(out.outputs[0].token_ids) == want
    assert kvbm_counter(f"{counter}@{tier}") > failures
    assert kvbm_counter("load_error_blocks") > errors


def serves_again(llm, plain, seed: int, tier: str = "disk") -> None:
    """The engine is alive and its tiers work: another prompt hits from
    ``tier`` (sealed under the page secret) and equals the recompute."""
    prompt, want = stored_only_below(llm, plain, seed, tier)
    settle(llm)
    matched = kvbm_counter(f"matched_tokens_{tier}")
    out = generate_request(llm, {"prompt_token_ids": prompt}, {"kv_load_tiers": [tier]})
    assert list(out.outputs[0].token_ids) == want
    assert kvbm_counter(f"matched_tokens_{tier}") - matched == 896


def test_a_corrupt_disk_page_is_recomputed(kvbm, plain, disk_dir):
    before = set(disk_dir.glob("*.pt"))
    prompt, want = stored_only_below(kvbm, plain, 9801, "disk")
    pages = sorted(set(disk_dir.glob("*.pt")) - before)
    assert pages
    for page in pages:  # one byte of each page file
        data = bytearray(page.read_bytes())
        data[HEADER_BYTES + 100] ^= 0xFF
        page.write_bytes(bytes(data))
    failed_then_recomputed(kvbm, prompt, want, "disk", "checksum_failures")
    serves_again(kvbm, plain, seed=9802)


def test_a_page_moved_on_the_remote_does_not_open_and_is_recomputed(kvbm, plain, redis_server):
    before = page_keys(redis_server)
    prompt, want = stored_only_below(kvbm, plain, 9811, "remote")
    settle(kvbm)
    pages = sorted(page_keys(redis_server) - before)
    assert len(pages) >= 2
    with redis_server.admin() as c:  # each page's bytes under the next one's name
        values = [c.get(p) for p in pages]
        for name, value in zip(pages, values[1:] + values[:1]):
            c.set(name, value)
    failed_then_recomputed(kvbm, prompt, want, "remote", "page_auth_failures")
    serves_again(kvbm, plain, 9812, "remote")


def test_pages_evicted_between_lookup_and_read_are_recomputed(kvbm, plain, redis_server, relay):
    prompt, want = stored_only_below(kvbm, plain, 9821, "remote")
    settle(kvbm)

    def evict():
        with redis_server.admin() as c:
            assert c.delete(*c.keys("kvbm_*"))

    relay.arm(evict)
    failed_then_recomputed(kvbm, prompt, want, "remote", "tier_read_misses")
    assert relay.fired.is_set()
    serves_again(kvbm, plain, 9822, "remote")


def test_a_read_past_the_remote_timeout_is_recomputed(kvbm, plain, relay):
    prompt, want = stored_only_below(kvbm, plain, 9831, "remote")
    settle(kvbm)
    relay.arm(lambda: time.sleep(REMOTE_TIMEOUT_S + 1.5))
    failed_then_recomputed(kvbm, prompt, want, "remote", "tier_read_errors")
    assert relay.fired.is_set()
    serves_again(kvbm, plain, seed=9832)
    time.sleep(3.0)  # the read link is made again (its first retry: 1-2 s)


def test_the_remote_killed_between_lookup_and_read_is_recomputed(kvbm, plain, redis_server, relay):
    prompt, want = stored_only_below(kvbm, plain, 9841, "remote")
    settle(kvbm)
    relay.arm(redis_server.kill)
    failed_then_recomputed(kvbm, prompt, want, "remote", "tier_read_errors")
    assert relay.fired.is_set()
    serves_again(kvbm, plain, seed=9842)
