"""The load/recompute split on a real engine, with a remote tier behind a slow link.

The LMCache server sits behind a proxy that paces its replies (about two
seconds per page), far slower than recomputing a block of the local model.
The engine learns that from one load, cut once it runs later than
recomputing (the pages landed kept, the rest recomputed), then serves a prompt whose first
blocks are in the host tier and the rest only on the slow server: it loads
the host part and recomputes the rest, and the greedy tokens equal a plain
engine's full recompute.
"""

from __future__ import annotations

import pytest

from helpers.engines import BLOCK_SIZE, kvbm_counter, make_llm, random_prompt, shutdown
from test_engine_e2e import generate, reference
from test_tiers_e2e import clear_engine_and_host, settle
from helpers.throttled_proxy import ThrottledProxy
from vllm_kvbm.tools.server import free_port, kvbm_transfer_config, start_lmcache_server
from vllm_kvbm.tools.server import stop_process as stop

# The engine learns the slow link from one timed load: a busy second worker skews it.
pytestmark = [pytest.mark.timeout(900), pytest.mark.timing]

HOST_BLOCKS = 40
SYSTEM = random_prompt(2 * BLOCK_SIZE, seed=9101)  # shared, hot: stays in the host tier
HISTORY = random_prompt(4 * BLOCK_SIZE, seed=9102)  # older: only on the slow server
PROMPT = SYSTEM + HISTORY + random_prompt(40, seed=9103)
OTHER = SYSTEM + random_prompt(2 * BLOCK_SIZE + 17, seed=9104)


@pytest.fixture(scope="module")
def slow_remote():
    port = free_port()
    server = start_lmcache_server(port)
    proxy = ThrottledProxy(port, rate=None)
    yield proxy
    proxy.close()
    stop(server)


def test_part_loaded_part_recomputed_equals_recompute(model_dir, plain_llm, slow_remote):
    want = reference(plain_llm, [PROMPT, OTHER])
    llm = make_llm(
        kvbm_transfer_config(
            host_cache_blocks=HOST_BLOCKS,
            remote_url=f"lm://127.0.0.1:{slow_remote.port}",
            remote_timeout_s=30,
        )
    )
    try:
        # Computed once (the engine times its prefills), written to the server.
        assert generate(llm, [PROMPT])[0] == [want[0]]
        clear_engine_and_host(llm, HOST_BLOCKS)  # only the server keeps PROMPT now

        # The link gets slow. OTHER's system-prompt blocks are found only on
        # the server, whose cost is not known yet: their load starts, runs
        # later than recomputing them would, and is cut at the pages landed
        # (at most the one being read when it was cut); vLLM recomputes the
        # rest. The cut measures the tier.
        slow_remote.rate = 2 << 20  # bytes per second
        remote_before = kvbm_counter("matched_tokens_remote")
        chosen = kvbm_counter("recompute_chosen_tokens")
        got, cached = generate(llm, [OTHER])
        assert got == [want[1]]
        assert kvbm_counter("matched_tokens_remote") - remote_before == len(SYSTEM)
        assert (
            len(SYSTEM) - BLOCK_SIZE
            <= kvbm_counter("recompute_chosen_tokens") - chosen
            <= len(SYSTEM)
        )
        settle(llm)
        assert llm.reset_prefix_cache()  # vLLM's own cache only

        # PROMPT: the system prompt is in the host tier again (promoted), its
        # history only on the slow server: load the first, recompute the rest.
        chosen = kvbm_counter("recompute_chosen_tokens")
        host = kvbm_counter("matched_tokens_host")
        remote = kvbm_counter("matched_tokens_remote")
        got, cached = generate(llm, [PROMPT])
        assert got == [want[0]]
        assert cached[0] == len(SYSTEM)
        assert kvbm_counter("matched_tokens_host") - host == len(SYSTEM)
        assert kvbm_counter("matched_tokens_remote") - remote == 0
        assert kvbm_counter("recompute_chosen_tokens") - chosen == len(HISTORY)
    finally:
        slow_remote.rate = None
        shutdown(llm)
