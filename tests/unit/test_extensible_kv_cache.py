"""vLLM 0.34's extensible KV cache against KVBM, read from 0.34's own worker sources.

KVBMConnector.unregister_kv_caches drains the workers' copies and stops them
(worker/kv_release.py), raising if one outlived its timeout: that is safe
only if vLLM calls it before it frees anything, in every place it is called. The
sources come from the release's wheel on PyPI as tools/vllm_wheels.py reads
them (cached; the same network policy as tests/unit/test_vllm_compat.py).
"""

from __future__ import annotations

import ast
import os

import pytest

from vllm_kvbm.tools import vllm_wheels as wheels

WORKER_MEMBERS = ("vllm/v1/worker/gpu_worker.py", "vllm/v1/worker/extensible_kv_cache.py")
# What frees the KV cache's memory after the connector was told.
FREES = {"release_physical", "suspend", "discard"}


def sources_034() -> dict[str, str]:
    try:
        index, _ = wheels.fetch_index()
        releases = [r for r in wheels.list_releases(index) if r.version.startswith("0.34.")]
        assert releases, "no vLLM 0.34 release in the index"
        return wheels.release_sources(releases[-1], WORKER_MEMBERS)
    except wheels.Offline as err:
        if os.environ.get("CI"):
            pytest.fail(str(err))
        pytest.skip(f"no network and nothing cached: {err}")


def call_sites(source: str) -> dict[str, tuple[int, int | None]]:
    """function -> (line of its unregister_kv_caches call, line of the first
    call after it that frees memory)."""
    found = {}
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        calls = sorted(
            (c.lineno, c.func.attr)
            for c in ast.walk(fn)
            if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
        )
        lines = [ln for ln, name in calls if name == "unregister_kv_caches"]
        if lines:
            frees = [ln for ln, name in calls if name in FREES and ln > lines[0]]
            found[fn.name] = (lines[0], frees[0] if frees else None)
    return found


def test_vllm_034_tells_the_connector_before_it_frees_the_kv_cache():
    sites = {}
    for member, source in sources_034().items():
        sites.update({f"{member}:{fn}": lines for fn, lines in call_sites(source).items()})
    # Every call site is known: a new one must be read before KVBM relies on it.
    assert sorted(sites) == [
        "vllm/v1/worker/extensible_kv_cache.py:_release_for_weight_update",
        "vllm/v1/worker/gpu_worker.py:discard",
        "vllm/v1/worker/gpu_worker.py:sleep",
    ]
    for where, (unregister, frees) in sites.items():
        # Draining (or raising) there comes before any memory is released.
        assert frees is not None and unregister < frees, where


def test_connector_needs_no_single_allocation_and_says_what_it_does():
    """The workers register no GPU KV memory (copy engines, by address), so
    KVBM asks nothing of the extensible KV cache's allocation; with it on,
    the startup line says what happens while vLLM releases its memory."""
    from types import SimpleNamespace

    import vllm_kvbm.connector as connector

    fn = next(
        f
        for f in ast.walk(ast.parse(open(connector.__file__).read()))
        if isinstance(f, ast.FunctionDef) and f.name == "kv_cache_access"
    )
    assert "KVCacheAccess.IN_PROCESS" in ast.unparse(fn)
    assert "KVCacheAccess.REGISTERS" not in ast.unparse(fn)
    on = connector.extensible_kv_cache_note(SimpleNamespace(enable_extensible_kv_cache=True))
    assert "registers none of its memory" in on and "none start until it is back" in on
    assert connector.extensible_kv_cache_note(SimpleNamespace()) is None  # vLLM 0.32, 0.33
    assert (
        connector.extensible_kv_cache_note(SimpleNamespace(enable_extensible_kv_cache=False))
        is None
    )
