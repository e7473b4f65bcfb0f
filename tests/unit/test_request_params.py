"""Per-request control through kv_transfer_params: the parsing of every
field (request_params.py), the `vllm serve` middleware's 400, and vLLM's
real scheduler honouring each limit (load off, store off, tiers, tokens)."""

from __future__ import annotations

import logging

import pytest
from fastapi import FastAPI, Request
from starlette.responses import PlainTextResponse
from starlette.testclient import TestClient

from helpers.scheduler_harness import (
    BLOCK,
    admit,
    kvbm,
    keys_of,
    lookup,
    make_request,
    make_scheduler,
    run_to_end,
    store_and_finish,
    tokens,
)
from helpers.tier_pages import disk_store_for, put_where_the_scheduler_sees
from vllm_kvbm.scheduler.request_params import (
    ALL,
    RequestParams,
    RequestParamsError,
    parse,
    parse_apart,
    report,
)
from vllm_kvbm.serve_middleware import check_kv_transfer_params

# ---- parsing ------------------------------------------------------------------

CPU, STORAGE, REMOTE = {"medium": "CPU"}, {"medium": "STORAGE"}, {"locality": "REMOTE"}


@pytest.mark.parametrize(
    "params,expected",
    [
        (None, ALL),
        ({}, ALL),
        ({"do_remote_prefill": False, "lmcache.tag.user": "a"}, ALL),  # others' keys left alone
        (
            {"kv_load_tiers": ["host", "disk"]},
            RequestParams(load_tiers=frozenset({"host", "disk"})),
        ),
        ({"kv_load_tiers": []}, RequestParams(load_tiers=frozenset())),
        (
            {"kv_load_tiers": [CPU]},
            RequestParams(load_tiers=frozenset({"host", "pool", "peer", "remote"})),
        ),
        (
            {"kv_load_tiers": [{"medium": "storage", "locality": "local"}]},
            RequestParams(load_tiers=frozenset({"disk"})),
        ),
        (
            {"kv_load_tiers": [REMOTE, "host"]},
            RequestParams(load_tiers=frozenset({"remote", "peer", "host"})),
        ),
        (
            {"kv_load_tiers": [{}]},
            RequestParams(load_tiers=frozenset({"host", "pool", "disk", "peer", "remote"})),
        ),
        (
            {"kv_load_tiers": ["host", "pool"]},
            RequestParams(load_tiers=frozenset({"host", "pool"})),
        ),
        (
            {"kv_store_tiers": ["host", "disk"]},
            RequestParams(store_tiers=frozenset({"host", "disk"})),
        ),
        ({"kv_store_tiers": []}, RequestParams(store_tiers=frozenset())),
        ({"lmcache.skip_save": True}, RequestParams(store_tiers=frozenset())),
        ({"lmcache.skip_save": False}, ALL),
        (
            {"lmcache.skip_save": True, "kv_store_tiers": ["host"]},
            RequestParams(store_tiers=frozenset()),
        ),
        ({"max_load_tokens": 0}, RequestParams(max_load_tokens=0)),
        ({"max_load_tokens": 256}, RequestParams(max_load_tokens=256)),
        ({"max_offload_tokens": 128}, RequestParams(max_store_tokens=128)),
        # where a router says the prefix is (scheduler/router_hints.py)
        (
            {
                "router_hint": {
                    "source_control_endpoint": "tcp://10.0.0.7:5600",
                    "block_hashes": [1, 2],
                }
            },
            RequestParams(peer="tcp://10.0.0.7:5600"),
        ),
        (
            {
                "kv_hint": {
                    "protocol_version": "0.1",
                    "actions": [
                        {
                            "action_type": "kv.fetch",
                            "action_version": "1.0",
                            "payload": {
                                "source_control_endpoint": "tcp://h:7000",
                                "block_hashes": [3],
                            },
                        }
                    ],
                }
            },
            RequestParams(peer="tcp://h:7000"),
        ),
        (
            {"remote_kv_source": {"remote_host": "::1", "remote_port": 5710, "kv_request_id": "x"}},
            RequestParams(peer="tcp://[::1]:5710"),
        ),
    ],
)
def test_parse(params, expected):
    assert parse(params) == expected


@pytest.mark.parametrize(
    "params,message",
    [
        ([1], "kv_transfer_params: expected an object, got list"),
        ({"kv_load_tiers": "host"}, "kv_load_tiers: expected a list, got 'host'; send a list of"),
        (
            {"kv_load_tiers": ["gpu"]},
            "kv_load_tiers: unknown tier 'gpu'; send a list of "
            "['host', 'pool', 'disk', 'peer', 'remote']",
        ),
        ({"kv_load_tiers": [3]}, "kv_load_tiers: entry 3 is neither a tier nor a matcher"),
        (
            {"router_hint": {"source_control_endpoint": "http://h:1"}},
            "router_hint.source_control_endpoint: 'http://h:1' is not a peer control endpoint",
        ),
        (
            {"router_hint": {"source_control_endpoint": "tcp://h:1", "block_hashes": [-1]}},
            "router_hint.block_hashes: expected a list of unsigned 64-bit integers",
        ),
        (
            {"kv_hint": {"actions": [{"action_type": "kv.fetch", "action_version": "2.0"}]}},
            "kv_hint: kv.fetch action_version '2.0' is not 1.x",
        ),
        (
            {"remote_kv_source": {"remote_host": "h"}},
            "remote_kv_source: expected remote_host (a string) and remote_port (an integer)",
        ),
        (
            {"kv_load_tiers": [{"medium": "GPU"}]},
            "kv_load_tiers: medium 'GPU' is not one of ['CPU', 'STORAGE']",
        ),
        (
            {"kv_load_tiers": [{"locality": 1}]},
            "kv_load_tiers: locality 1 is not one of ['LOCAL', 'REMOTE']",
        ),
        ({"kv_load_tiers": [{"tier": "host"}]}, "kv_load_tiers: unknown matcher field 'tier'"),
        (
            {"kv_store_tiers": ["remote"]},
            "kv_store_tiers: ['remote'] leaves out \"host\", through which every store passes; "
            'add "host", or send [] to store nothing',
        ),
        ({"kv_store_tiers": ["host", "tape"]}, "kv_store_tiers: unknown tier 'tape'"),
        ({"lmcache.skip_save": "yes"}, "lmcache.skip_save: expected true or false, got 'yes'"),
        (
            {"max_load_tokens": -1},
            "max_load_tokens: expected a whole number of tokens >= 0, got -1",
        ),
        (
            {"max_load_tokens": 1.5},
            "max_load_tokens: expected a whole number of tokens >= 0, got 1.5",
        ),
        (
            {"max_load_tokens": True},
            "max_load_tokens: expected a whole number of tokens >= 0, got True",
        ),
        (
            {"max_offload_tokens": "128"},
            "max_offload_tokens: expected a whole number of tokens >= 0, got '128'",
        ),
    ],
)
def test_bad_values_name_the_field_and_the_fix(params, message):
    with pytest.raises(RequestParamsError) as err:
        parse(params)
    assert message in str(err.value)
    assert report(params) == {"kvbm_error": str(err.value)}


def test_good_params_report_nothing():
    assert report({"kv_load_tiers": ["host"]}) is None and report(None) is None


# ---- the `vllm serve` middleware ------------------------------------------------------


def _client() -> TestClient:
    """An app that echoes the body it got, with the middleware as
    `vllm serve --middleware` adds it (FastAPI's app.middleware("http"))."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def echo(request: Request):
        return PlainTextResponse((await request.body()).decode())

    app.middleware("http")(check_kv_transfer_params)
    return TestClient(app)


def test_middleware_answers_400_naming_the_field():
    resp = _client().post(
        "/v1/completions", json={"prompt": "x", "kv_transfer_params": {"max_load_tokens": -5}}
    )
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "kv_transfer_params" and error["code"] == 400
    assert error["message"].startswith("max_load_tokens: expected a whole number")


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "x", "kv_transfer_params": {"kv_load_tiers": ["disk"]}},
        {"prompt": "x"},
        {"prompt": "x", "kv_transfer_params": None},
    ],
)
def test_middleware_passes_good_requests_with_their_body(body):
    import json

    resp = _client().post("/v1/completions", json=body)
    assert resp.status_code == 200 and json.loads(resp.text) == body


# ---- the scheduler honours them ------------------------------------------------------


def with_params(toks, params, max_tokens=2):
    req = make_request(toks, max_tokens=max_tokens)
    req.kv_transfer_params = params  # as vLLM sets it from SamplingParams.extra_args
    return req


def stored_keys(metas, k) -> int:
    return sum(len(job.slots) for meta in metas for job in meta.stores)


@pytest.mark.parametrize(
    "params", [{"lmcache.skip_save": True}, {"max_offload_tokens": 0}, {"kv_store_tiers": []}]
)
def test_store_off_stores_nothing(params):
    sched = make_scheduler(host_blocks=16)
    toks = tokens(3 * BLOCK + 3, 40)
    metas = run_to_end(sched, with_params(toks, params))
    assert stored_keys(metas, kvbm(sched)) == 0
    assert not any(key in kvbm(sched).host for key in keys_of(sched, toks))
    # the same prompt without params is stored: the test can see a store
    assert stored_keys(run_to_end(sched, make_request(toks, max_tokens=2)), kvbm(sched)) == 3


def test_max_offload_tokens_stores_that_many_pages_from_the_start():
    sched = make_scheduler(host_blocks=16)
    toks = tokens(3 * BLOCK + 3, 41)
    run_to_end(sched, with_params(toks, {"max_offload_tokens": BLOCK + 5}))
    keys = keys_of(sched, toks)
    assert [key in kvbm(sched).host for key in keys] == [True, False, False]


def stored_then_asked(sched, toks, params):
    store_and_finish(sched, toks)
    assert sched.reset_prefix_cache()
    return lookup(kvbm(sched), with_params(toks, params))


@pytest.mark.parametrize(
    "params",
    [
        {"kv_load_tiers": []},
        {"max_load_tokens": 0},
        {"kv_load_tiers": ["disk"]},
        {"kv_load_tiers": [STORAGE]},
    ],
)
def test_load_off_or_without_the_host_tier_finds_nothing(params):
    sched = make_scheduler(host_blocks=16)
    toks = tokens(3 * BLOCK + 3, 42)
    assert stored_then_asked(sched, toks, params) == (0, False)
    assert lookup(kvbm(sched), make_request(toks)) == (3 * BLOCK, True)  # there to load


@pytest.mark.parametrize(
    "limit,hit",
    [(BLOCK, BLOCK), (2 * BLOCK + 7, 2 * BLOCK), (BLOCK - 1, 0), (10 * BLOCK, 3 * BLOCK)],
)
def test_max_load_tokens_limits_the_hit_to_whole_pages(limit, hit):
    sched = make_scheduler(host_blocks=16)
    toks = tokens(3 * BLOCK + 3, 43)
    assert stored_then_asked(sched, toks, {"max_load_tokens": limit}) == (hit, hit > 0)


def test_a_loaded_request_with_max_load_tokens_loads_that_much():
    sched = make_scheduler(host_blocks=16)
    toks = tokens(3 * BLOCK + 3, 44)
    store_and_finish(sched, toks)
    assert sched.reset_prefix_cache()
    req = with_params(toks, {"max_load_tokens": 2 * BLOCK})
    sched.add_request(req)
    _, meta, _ = admit(sched, req)
    (load,) = meta.loads
    assert len(load.block_ids) == 2


@pytest.fixture
def disk_sched(tmp_path):
    sched = make_scheduler(host_blocks=8, disk_cache_dir=str(tmp_path), disk_cache_size="64MiB")
    store = disk_store_for(kvbm(sched), tmp_path)
    yield sched, store
    store.close()


@pytest.mark.parametrize(
    "params,hit",
    [
        ({"kv_load_tiers": ["host"]}, 0),
        ({"kv_load_tiers": [CPU]}, 0),
        ({"kv_load_tiers": ["disk"]}, 2 * BLOCK),
        ({"kv_load_tiers": [{"medium": "STORAGE", "locality": "LOCAL"}]}, 2 * BLOCK),
        (None, 2 * BLOCK),
    ],
)
def test_load_tiers_keep_a_hit_to_those_tiers(disk_sched, params, hit):
    sched, store = disk_sched
    toks = tokens(2 * BLOCK + 5, 45)
    put_where_the_scheduler_sees(store, kvbm(sched), keys_of(sched, toks))
    assert lookup(kvbm(sched), with_params(toks, params)) == (hit, hit > 0)


def spilled_tiers(sched, req) -> list[str]:
    return [tier for meta in run_to_end(sched, req) for job in meta.spills for tier in job.tiers]


def test_store_tiers_keep_stores_to_those_tiers(disk_sched):
    sched, _ = disk_sched
    host_only = with_params(tokens(2 * BLOCK + 5, 46), {"kv_store_tiers": ["host"]})
    assert spilled_tiers(sched, host_only) == []
    assert all(key in kvbm(sched).host for key in keys_of(sched, host_only.prompt_token_ids))
    both = with_params(tokens(2 * BLOCK + 5, 47), {"kv_store_tiers": ["host", "disk"]})
    assert spilled_tiers(sched, both) == ["disk"]


def test_a_bad_load_field_turns_loading_off_and_still_stores(caplog):
    sched = make_scheduler(host_blocks=16)
    toks = tokens(3 * BLOCK + 3, 48)
    store_and_finish(sched, toks)
    assert sched.reset_prefix_cache()
    bad = with_params(toks, {"kv_load_tiers": ["gpu"]})
    with caplog.at_level(logging.WARNING, logger="vllm_kvbm"):
        assert lookup(kvbm(sched), bad) == (0, False)
    assert (
        f"request {bad.request_id}: kv_load_tiers: unknown tier 'gpu'" in caplog.text
        and "(it loads no KV)" in caplog.text
    )
    fresh = tokens(2 * BLOCK + 3, 49)
    assert (
        stored_keys(run_to_end(sched, with_params(fresh, {"max_load_tokens": -1})), kvbm(sched))
        == 2
    )


def test_a_bad_store_field_turns_storing_off_and_still_loads(caplog):
    sched = make_scheduler(host_blocks=16)
    toks = tokens(3 * BLOCK + 3, 50)
    store_and_finish(sched, toks)
    assert sched.reset_prefix_cache()
    bad = with_params(toks, {"max_offload_tokens": -1, "kv_load_tiers": ["host"]})
    with caplog.at_level(logging.WARNING, logger="vllm_kvbm"):
        assert lookup(kvbm(sched), bad) == (3 * BLOCK, True)
    assert "max_offload_tokens: expected a whole number" in caplog.text
    assert "(it stores no KV)" in caplog.text
    fresh = tokens(2 * BLOCK + 3, 51)
    assert (
        stored_keys(
            run_to_end(sched, with_params(fresh, {"kv_store_tiers": ["disk"]})), kvbm(sched)
        )
        == 0
    )


def test_both_halves_bad_are_both_off_and_both_named():
    params = {"kv_load_tiers": "host", "lmcache.skip_save": "yes"}
    got, errors = parse_apart(params)
    assert not got.loads and not got.stores and len(errors) == 2
    assert report(params) == {"kvbm_error": "; ".join(errors)}


def test_a_bad_hint_is_ignored_and_the_request_loads_and_stores_as_asked():
    got, errors = parse_apart({"router_hint": 5, "kv_load_tiers": ["host", "disk"]})
    assert got.peer is None and got.loads and got.stores
    assert got.load_tiers == frozenset({"host", "disk"})
    assert errors == [str(errors[0])] and errors[0].startswith("router_hint: expected an object")


def test_refused_parts_are_counted_once_per_request_by_part():
    """kvbm_refused_param_requests_total{param}: each refused part of a
    request's params, once, when the scheduler first sees the request."""
    sched = make_scheduler(host_blocks=16)
    k = kvbm(sched)
    for i, params in enumerate(
        [
            {"kv_load_tiers": ["gpu"]},
            {"max_offload_tokens": -1, "router_hint": 5},
            {"kv_load_tiers": ["host"]},
        ]
    ):
        req = with_params(tokens(2 * BLOCK + 3, 60 + i), params)
        lookup(k, req)
        lookup(k, req)  # asked again (a later step): counted once
    counters = k.stats.take()["counters"]
    assert {key: n for key, n in counters.items() if key.startswith("refused_params@")} == {
        "refused_params@load": 1,
        "refused_params@store": 1,
        "refused_params@hint": 1,
        "refused_params@object": 0,
    }
    assert parse_apart(["host"])[0].refused == ("object",)
