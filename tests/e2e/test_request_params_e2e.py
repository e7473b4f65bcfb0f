"""Per-request control through kv_transfer_params, as clients send it: one
`vllm serve` (host and disk tiers, the 400 middleware) for the OpenAI API's
``kv_transfer_params`` field, and the session LLM engine for
``SamplingParams(extra_args={"kv_transfer_params": ...})``.

Each probe empties vLLM's own prefix cache first, so the tokens a response
reports cached (``usage.prompt_tokens_details.cached_tokens``) are the ones
KVBM loaded."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from helpers.engines import BLOCK_SIZE, MODEL_DIR, random_prompt
from vllm_kvbm.tools.server import kvbm_transfer_config, vllm_server

pytestmark = pytest.mark.timeout(1800)

PAGE = 128  # tokens per block and page under these serve args
PROMPT = 3 * PAGE + 10  # three full pages (vLLM computes the last tokens itself)
SERVE_ARGS = [
    "--enforce-eager",
    "--max-model-len",
    "2048",
    "--kv-cache-memory-bytes",
    "512M",
    "--num-gpu-blocks-override",
    "32",
    "--block-size",
    str(PAGE),
    "--enable-prompt-tokens-details",
    "--middleware",
    "vllm_kvbm.serve_middleware.check_kv_transfer_params",
]


class Client:
    def __init__(self, server):
        self.server = server

    def complete(self, prompt: list[int], params: dict | None = None) -> tuple[int, dict]:
        """A greedy 2-token completion: (HTTP status, its JSON)."""
        body = {
            "model": self.server.model,
            "prompt": prompt,
            "max_tokens": 2,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        if params is not None:
            body["kv_transfer_params"] = params
        req = urllib.request.Request(
            f"{self.server.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=300) as resp:
                return resp.status, json.load(resp)
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def cached(self, prompt: list[int], params: dict | None = None) -> int:
        """Tokens KVBM loaded for ``prompt`` sent with ``params`` (vLLM's own
        prefix cache emptied first)."""
        self.reset()
        status, out = self.complete(prompt, params)
        assert status == 200, out
        return (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0

    def reset(self) -> None:
        req = urllib.request.Request(f"{self.server.url}/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert json.load(resp)["success"]


@pytest.fixture(scope="module")
def client(model_dir, tmp_path_factory):
    disk = tmp_path_factory.mktemp("kvbm-disk")
    # A host tier of 6 pages: three more prompts push a prompt's pages out to disk.
    kv = kvbm_transfer_config(
        host_cache_blocks=6, disk_cache_dir=str(disk), disk_cache_size="64MiB", load_split=False
    )
    with vllm_server(
        str(MODEL_DIR), kv, SERVE_ARGS, startup_timeout=900, env={"VLLM_SERVER_DEV_MODE": "1"}
    ) as server:
        yield Client(server)


def prompt(seed: int) -> list[int]:
    return random_prompt(PROMPT, seed=seed)


@pytest.mark.parametrize(
    "seed,params",
    [
        (10, {"lmcache.skip_save": True}),
        (11, {"max_offload_tokens": 0}),
        (12, {"kv_store_tiers": []}),
    ],
)
def test_store_off_is_not_stored(client, seed, params):
    p = prompt(seed)
    assert client.complete(p, params)[0] == 200
    assert client.cached(p) == 0  # a repeat finds nothing
    assert client.cached(p) == 3 * PAGE  # the repeat itself was stored


@pytest.mark.parametrize("seed,params", [(20, {"kv_load_tiers": []}), (21, {"max_load_tokens": 0})])
def test_load_off_does_not_load(client, seed, params):
    p = prompt(seed)
    assert client.complete(p)[0] == 200  # stored
    assert client.cached(p, params) == 0
    assert client.cached(p) == 3 * PAGE  # there to load all along


def test_max_tokens_limit_loads_and_stores(client):
    p = prompt(30)
    assert client.complete(p, {"max_offload_tokens": PAGE + 5})[0] == 200
    assert client.cached(p) == PAGE  # only the first page was stored
    q = prompt(31)
    assert client.complete(q)[0] == 200
    assert client.cached(q, {"max_load_tokens": 2 * PAGE + 7}) == 2 * PAGE


def test_tier_filters_keep_loads_and_stores_to_those_tiers(client):
    host_only = prompt(40)
    assert client.complete(host_only, {"kv_store_tiers": ["host"]})[0] == 200
    assert client.cached(host_only, {"kv_load_tiers": ["disk"]}) == 0  # in the host tier
    assert client.cached(host_only, {"kv_load_tiers": [{"medium": "CPU"}]}) == 3 * PAGE
    # Stored to both, then pushed out of the 6-page host tier by three others.
    both = prompt(41)
    assert client.complete(both)[0] == 200
    for seed in (42, 43, 44):
        assert client.complete(prompt(seed), {"kv_store_tiers": ["host"]})[0] == 200
    # (stored nowhere, or the next probe would find it in the host tier)
    assert client.cached(both, {"kv_load_tiers": ["host", "remote"], "kv_store_tiers": []}) == 0
    assert client.cached(both, {"kv_load_tiers": ["disk"]}) == 3 * PAGE


@pytest.mark.parametrize(
    "params,message",
    [
        ({"kv_load_tiers": ["gpu"]}, "kv_load_tiers: unknown tier 'gpu'"),
        (
            {"max_load_tokens": -1},
            "max_load_tokens: expected a whole number of tokens >= 0, got -1",
        ),
        ({"lmcache.skip_save": "yes"}, "lmcache.skip_save: expected true or false"),
    ],
)
def test_bad_value_gets_a_400_naming_the_field(client, params, message):
    status, out = client.complete(prompt(50), params)
    assert status == 400 and message in out["error"]["message"], out
    assert client.complete(prompt(50))[0] == 200  # the engine serves on


# ---- LLM: SamplingParams(extra_args={"kv_transfer_params": ...}) ----------------------


def llm_generate(llm, p, params=None):
    from vllm import SamplingParams

    extra = None if params is None else {"kv_transfer_params": params}
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, extra_args=extra)
    (out,) = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)
    return out


def test_llm_sampling_params_carry_them(kvbm_llm):
    p = random_prompt(3 * BLOCK_SIZE + 10, seed=60)
    llm_generate(kvbm_llm, p)  # stored
    kvbm_llm.reset_prefix_cache()
    assert llm_generate(kvbm_llm, p, {"kv_load_tiers": []}).num_cached_tokens == 0
    kvbm_llm.reset_prefix_cache()
    assert (
        llm_generate(kvbm_llm, p, {"max_load_tokens": BLOCK_SIZE}).num_cached_tokens == BLOCK_SIZE
    )
    kvbm_llm.reset_prefix_cache()
    # A refused store field: it still loads (and stores nothing); its output says why.
    out = llm_generate(kvbm_llm, p, {"max_offload_tokens": "all"})
    assert out.num_cached_tokens == 3 * BLOCK_SIZE
    assert "max_offload_tokens: expected a whole number" in out.kv_transfer_params["kvbm_error"]
    # A refused load field: nothing loaded.
    kvbm_llm.reset_prefix_cache()
    out = llm_generate(kvbm_llm, p, {"max_load_tokens": "all"})
    assert out.num_cached_tokens == 0
    assert "max_load_tokens: expected a whole number" in out.kv_transfer_params["kvbm_error"]
