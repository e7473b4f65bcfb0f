"""The connector's reset as vLLM makes it while it pauses (and so while it
sleeps), on vLLM's real EngineCore and Scheduler (scheduler/cache_reset.py):
the host tier keeps its pages, which are keyed by the weights they were
computed with; a reset the user asks for clears it as before.

The EngineCore runs in this process without its executor: a stand-in takes
the calls a pause, a sleep and a wake-up make on the workers.
"""

from __future__ import annotations

from helpers.scheduler_harness import (
    BLOCK,
    kvbm,
    keys_of,
    lookup,
    make_request,
    make_scheduler,
    step,
    store_and_finish,
    tokens,
)


class Executor:
    """What EngineCore calls on its executor here; sleep frees nothing."""

    def __init__(self):
        self.calls: list = []
        self.is_sleeping = False

    def collective_rpc(self, method, *args, **kwargs):
        self.calls.append(method)

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))
        self.is_sleeping = True

    def wake_up(self, tags=None) -> None:
        self.calls.append(("wake_up", tags))
        self.is_sleeping = False

    def discard(self, tags) -> None:
        self.calls.append(("discard", tags))

    def reset_mm_cache(self) -> None:
        pass

    def reset_encoder_cache(self) -> None:
        pass


def _engine(scheduler):
    from vllm.v1.engine.core import EngineCore

    engine = object.__new__(EngineCore)
    engine.scheduler = scheduler
    engine.model_executor = Executor()
    engine.mm_receiver_cache = None
    engine.batch_queue = None
    return engine


def _stored(s, base: int):
    """A prompt of 3 pages, run to its end: its pages in the host tier."""
    prompt = tokens(3 * BLOCK + 5, base)
    store_and_finish(s, prompt)
    keys = keys_of(s, prompt)[:3]
    assert all(kvbm(s).host.is_ready(key) for key in keys)
    return prompt, keys


def test_a_sleep_keeps_the_host_tier_and_its_pages_hit_after_wake_up():
    from vllm.v1.engine.core import EngineCore

    s = make_scheduler(host_blocks=16)
    k = kvbm(s)
    prompt, keys = _stored(s, 71)
    engine = _engine(s)
    EngineCore.sleep(engine, level=1)
    assert engine.model_executor.calls == ["synchronize_device", ("sleep", 1)]
    assert (
        s.kv_cache_manager.block_pool.get_num_free_blocks()
        == s.kv_cache_manager.block_pool.num_gpu_blocks - 1
    )  # vLLM's own cache was reset
    assert all(k.host.is_ready(key) for key in keys)  # the connector's reset kept them
    assert EngineCore.wake_up(engine) is True
    req = make_request(prompt, max_tokens=1)
    assert lookup(k, req)[0] == 3 * BLOCK
    s.add_request(req)
    _, meta, _ = step(s)
    [load] = meta.loads
    assert not load.fetch and k.hit_sources(req, 3 * BLOCK) == {"host": 3 * BLOCK}

    # release_kv_cache_memory() completes a pause too.
    EngineCore.sleep(engine, level=0)  # a pause with the cache kept (level 0)
    step(s, finished_recving=[req.request_id])
    while s.has_requests():
        step(s, complete=True)
    EngineCore.release_kv_cache_memory(engine)
    assert engine.model_executor.calls[-1] == ("discard", ("kv_cache",))
    assert all(k.host.is_ready(key) for key in keys)


def test_an_explicit_reset_clears_the_host_tier_paused_or_not():
    from vllm.v1.engine.core import EngineCore

    s = make_scheduler(host_blocks=16)
    k = kvbm(s)
    engine = _engine(s)
    _, keys = _stored(s, 72)
    assert EngineCore.reset_prefix_cache(engine, reset_connector=True)
    assert not any(k.host.is_ready(key) for key in keys)

    # Paused without clearing (a level-0 sleep), then the user's reset: not
    # the pause's own, so it clears.
    _, keys = _stored(s, 73)
    EngineCore.sleep(engine, level=0)
    assert EngineCore.is_scheduler_paused(engine)
    assert EngineCore.reset_prefix_cache(engine, reset_connector=True)
    assert not any(k.host.is_ready(key) for key in keys)
    EngineCore.wake_up(engine, tags=["scheduling"])

    # vLLM's cache-clearing path while not paused: unsure, so as before.
    _, keys = _stored(s, 74)
    EngineCore._reset_caches(engine)
    assert not any(k.host.is_ready(key) for key in keys)
