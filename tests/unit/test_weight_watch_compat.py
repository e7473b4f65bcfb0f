"""Where KVBM watches vLLM's weight changes and weight files, in every
supported vLLM release (their sources read out of the PyPI wheels,
tools/vllm_wheels.py): the collective_rpc dispatch it wraps
(worker/weight_changes.py), the load path whose pairs it digests, the
weight-transfer engines it identifies, and the loader call that picks weight
files (opened_files.py)."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

from vllm_kvbm.tools import vllm_wheels as wheels
from vllm_kvbm.worker.read_only_rpcs import (
    IDENTIFIED,
    LOADING_TRANSFER_ENGINES,
    NOT_READ_ONLY,
    READ_ONLY,
    SLEEP_MODE,
)

FILES = {
    "multiproc": "vllm/v1/executor/multiproc_executor.py",
    "uniproc": "vllm/v1/executor/uniproc_executor.py",
    "loader": "vllm/model_executor/model_loader/default_loader.py",
    "reload": "vllm/model_executor/model_loader/reload/inplace.py",
    **{cls: cls.rsplit(".", 1)[0].replace(".", "/") + ".py" for cls in LOADING_TRANSFER_ENGINES},
}


# The files that send collective_rpc calls by name in vLLM 0.32 (the
# installed release is read whole; the others' are these files).
SENDERS = (
    "vllm/v1/executor/abstract.py",
    "vllm/v1/executor/multiproc_executor.py",
    "vllm/v1/executor/uniproc_executor.py",
    "vllm/v1/executor/ray_executor.py",
    "vllm/v1/engine/core.py",
    "vllm/v1/engine/llm_engine.py",
    "vllm/v1/engine/async_llm.py",
    "vllm/entrypoints/llm.py",
    "vllm/entrypoints/rl/offline.py",
    "vllm/entrypoints/rl/online/api_router.py",
    "vllm/distributed/elastic_ep/elastic_state.py",
    "vllm/v1/fault_tolerance/engine_core_sentinel.py",
)
WORKERS = ("vllm/v1/worker/gpu_worker.py", "vllm/v1/worker/worker_base.py")


def _by_release(members, optional: bool = False) -> dict[str, dict[str, str]]:
    sources = {"installed": {m: wheels.installed_source(m)[1] for m in members}}
    try:
        index, _ = wheels.fetch_index()
        for release in wheels.list_releases(index):
            sources[release.version] = wheels.release_sources(release, members, optional)
    except wheels.Offline as err:
        if os.environ.get("CI"):
            pytest.fail(str(err))
        pytest.skip(f"no network and nothing cached: {err}")
    return sources


@pytest.fixture(scope="module")
def releases() -> dict[str, dict[str, str]]:
    return _by_release(list(FILES.values()))


def _sent(text: str) -> set[str]:
    return set(re.findall(r"collective_rpc\(\s*\"(\w+)\"", text))


def test_every_method_vllm_sends_through_collective_rpc_is_reviewed():
    """The method names vLLM's engine, executors and entrypoints send by
    name: each is reviewed, read-only or not (read_only_rpcs.py), so one a
    release adds is looked at before it moves every engine off its files'
    keys at each call, or counts as read-only unseen."""
    import vllm

    sent = {"installed": set()}
    for path in Path(vllm.__file__).parent.rglob("*.py"):
        if "tests" not in path.parts:
            sent["installed"] |= _sent(path.read_text())
    for version, files in _by_release(SENDERS, optional=True).items():
        sent.setdefault(version, set()).update(*map(_sent, files.values()))
    assert {
        "execute_model",
        "sample_tokens",
        "determine_available_memory",
        "get_kv_connector_handshake_metadata",
    } <= sent["installed"]  # the scan finds them
    reviewed = set(READ_ONLY) | set(IDENTIFIED) | set(SLEEP_MODE) | set(NOT_READ_ONLY)
    unreviewed = {v: names - reviewed for v, names in sent.items() if names - reviewed}
    assert not unreviewed, f"review these in vllm_kvbm/worker/read_only_rpcs.py: {unreviewed}"


def test_the_reviewed_methods_are_methods_of_vllms_worker():
    """A typo would make a read-only call a change: every step an engine
    would lose its files' keys (safe, but every page private)."""
    defined = set()
    for files in _by_release(WORKERS).values():
        for text in files.values():
            defined |= {n.name for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef)}
    for name in [*READ_ONLY, *IDENTIFIED, *SLEEP_MODE]:  # (a name NOT_READ_ONLY lists
        assert name in defined, name  # counts as a change anyway)
    sets = [set(READ_ONLY), set(IDENTIFIED), set(SLEEP_MODE), set(NOT_READ_ONLY)]
    assert sum(map(len, sets)) == len(set().union(*sets))  # each name in one place


def _methods(source: str, cls: str) -> dict[str, ast.FunctionDef]:
    [node] = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == cls]
    return {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)}


def test_every_release_dispatches_collective_rpc_where_kvbm_watches(releases):
    for version, source in releases.items():
        proc = _methods(source[FILES["multiproc"]], "WorkerProc")
        run = proc["_execute_worker_rpc"]
        assert [a.arg for a in run.args.args] == ["self", "rpc_request"], version
        assert "method, args, kwargs, output_rank = rpc_request" in ast.unparse(run), version
        assert "self._execute_worker_rpc(" in ast.unparse(proc["worker_busy_loop"]), version
        uni = _methods(source[FILES["uniproc"]], "UniProcExecutor")
        assert [a.arg for a in uni["collective_rpc"].args.args][:2] == ["self", "method"], version
        for name in ("execute_model", "sample_tokens", "take_draft_token_ids"):
            body = ast.unparse(uni[name])
            assert "self.collective_rpc(" in body and "driver_worker" not in body, (version, name)


def test_every_release_loads_weights_through_the_models_load_weights(releases):
    for version, source in releases.items():
        assert "model.load_weights(weights_iterator)" in source[FILES["reload"]], version
        for cls in LOADING_TRANSFER_ENGINES:
            module, name = cls.rsplit(".", 1)
            body = ast.unparse(_methods(source[FILES[cls]], name)["receive_weights"])
            assert "model.load_weights" in body, (version, name)
            # any other way in is a load plan, which weight_changes.py checks for
            assert "load_planned" not in body or "self._plan" in body, (version, name)


def test_every_release_picks_weight_files_where_kvbm_records_them(releases):
    for version, source in releases.items():
        loader = _methods(source[FILES["loader"]], "DefaultModelLoader")
        prepare = [a.arg for a in loader["_prepare_weights"].args.args]
        assert prepare[:3] == ["self", "model_name_or_path", "subfolder"], version
        for caller in ("_get_weights_iterator", "download_model"):
            assert "self._prepare_weights(" in ast.unparse(loader[caller]), (version, caller)
        # the folder first, the files second (opened_files._patch reads them so)
        body = ast.unparse(loader["_prepare_weights"])
        assert "return (hf_folder, hf_weights_files" in body, version
