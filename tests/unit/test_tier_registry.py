"""tiers/registry.py, tiers/base.py and tiers/reconnect.py: which medium serves
each configured tier, the interfaces every medium implements, and the one
reconnect policy of the network tiers."""

from __future__ import annotations

import logging
import random
import socket
from types import SimpleNamespace

import pytest

from vllm_kvbm.config import load_config
from vllm_kvbm.config.urls import _RESP_SCHEMES
from vllm_kvbm.tiers import registry
from vllm_kvbm.tiers.base import TierStore, TierView
from vllm_kvbm.tiers.reconnect import Reconnect

PAGE = 4096


def _info():
    """What the registry reads of EngineInfo (a real one needs a vLLM config)."""
    return SimpleNamespace(
        tier_namespace="ns-registry",
        page_bytes=PAGE,
        key_namespace=SimpleNamespace(tp_size=1),
        data_parallel_index=0,
    )


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("scheme", ["lm", *sorted(_RESP_SCHEMES)])
def test_every_remote_url_scheme_config_accepts_has_a_medium(scheme):
    url = "lm://127.0.0.1:9" if scheme == "lm" else f"{scheme}://127.0.0.1:9"
    (medium,) = registry.configured(load_config({"remote_url": url}, environ={}))
    folder = "lm" if scheme == "lm" else "redis"
    assert medium.view.startswith(f"vllm_kvbm.tiers.{folder}.view:")
    assert issubclass(medium.view_class(), TierView)
    assert issubclass(medium.store_class(), TierStore)
    if scheme != "lm":  # a cluster URL is the same medium
        cluster = load_config({"remote_url": f"{scheme}+cluster://127.0.0.1:9"}, environ={})
        assert registry.configured(cluster) == [medium]


def test_views_and_stores_follow_the_config_disk_first(tmp_path):
    config = load_config(
        {
            "disk_cache_dir": str(tmp_path),
            "disk_cache_size": "1MiB",
            "remote_url": f"lm://127.0.0.1:{_dead_port()}",
        },
        environ={},
    )
    assert registry.configured(config) == [registry.DISK, registry.REMOTE["lm"]]
    views = registry.open_views(config, _info())
    try:
        assert [type(v).__name__ for v in views] == ["DiskView", "RemoteView"]
        assert [v.name for v in views] == ["disk", "remote"]
        # nothing stored, and a server that refuses connections: misses, no error
        assert [v.contains_many([b"k" * 32]) for v in views] == [[False], [False]]
    finally:
        for view in views:
            view.close()
    disk_only = load_config(
        {"disk_cache_dir": str(tmp_path), "disk_cache_size": "1MiB"}, environ={}
    )
    (store,) = registry.open_stores(disk_only, _info(), rank=0)
    try:
        assert isinstance(store, TierStore) and store.name == "disk"
    finally:
        store.close()
    assert registry.open_views(load_config({}, environ={}), _info()) == []


def test_a_medium_missing_a_method_cannot_be_made():
    class NoGet(TierStore):
        def put(self, key, page):
            return False

    class NoContains(TierView):
        pass

    with pytest.raises(TypeError, match="get_into"):
        NoGet()
    with pytest.raises(TypeError, match="contains"):
        NoContains()


class _Lines(logging.Handler):
    """The messages one logger emits (caplog may see a record twice once
    vLLM's logging is set up by an earlier test)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_reconnect_tries_once_per_interval_and_logs_each_outage_once():
    log = logging.getLogger("vllm_kvbm.tiers.reconnect")
    seen = _Lines()
    log.addHandler(seen)
    try:
        r = Reconnect(3600, "remote tier", "lm://h:1", "for reads")
        assert r.may_try()
        assert not r.may_try()  # the interval's attempt is spent
        r.answered()  # never down: nothing to say
        assert seen.lines == [] and r.state == "up"
        r.failed(ConnectionRefusedError("refused"))
        r.failed(TimeoutError("again"))
        assert len(seen.lines) == 1
        assert "remote tier lm://h:1 unavailable for reads (refused)" in seen.lines[0]
        assert not r.may_try() and r.state == "down"
        r.answered()
        r.answered()
        assert seen.lines[1:] == ["KVBM: remote tier lm://h:1 reachable again for reads"]
    finally:
        log.removeHandler(seen)
    eager = Reconnect(0, "remote tier", "redis://h:1")
    eager.failed("down")
    assert eager.may_try() and eager.may_try()


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _outage_waits(seed: int, attempts: int = 8) -> list[float]:
    """The waits between reconnect attempts of one outage, on a fake clock, with
    the jitter's ``random`` seeded (its state is put back after)."""
    clock = _Clock()
    state = random.getstate()
    random.seed(seed)
    try:
        r = Reconnect(2.0, "remote tier", "redis://h:1", clock=clock)
        r.failed("refused")
        waits = []
        for _ in range(attempts):
            waits.append(r.wait_s())
            assert not r.may_try()
            clock.now += waits[-1]
            assert r.may_try()
            r.failed("refused")
            r.failed("refused again")  # calls failing together are one failed attempt
    finally:
        random.setstate(state)
    return waits


def test_reconnect_backoff_doubles_with_jitter_to_a_bound_and_resets_on_an_answer():
    waits = _outage_waits(seed=7)
    steps = [2, 4, 8, 16, 16, 16, 16, 16]  # doubling from 2 s, bounded at 8 x 2 s
    for wait, step in zip(waits, steps):
        assert step / 2 <= wait <= step, (waits, steps)
    assert waits == _outage_waits(seed=7)  # the seeded schedule is the schedule
    # another engine of the fleet (another seed) does not retry in step
    assert all(a != b for a, b in zip(waits, _outage_waits(seed=8)))
    # an answer resets it: the next outage starts from the first step again
    clock = _Clock()
    r = Reconnect(2.0, "remote tier", "redis://h:1", clock=clock)
    for _ in range(5):
        r.failed("refused")
        clock.now += r.wait_s()
        assert r.may_try()
    r.answered()
    r.failed("refused")
    assert 1.0 <= r.wait_s() <= 2.0
