"""Where KVBM watches vLLM's weight changes and weight files, in every
supported vLLM release (their sources read out of the PyPI wheels,
tools/vllm_wheels.py): the collective_rpc dispatch it wraps
(worker/weight_changes.py), the load path whose pairs it digests, the
weight-transfer engines it identifies, and the loader call that picks weight
files (opened_files.py)."""

from __future__ import annotations

import ast
import os

import pytest

from vllm_kvbm.tools import vllm_wheels as wheels
from vllm_kvbm.worker.read_only_rpcs import LOADING_TRANSFER_ENGINES

FILES = {
    "multiproc": "vllm/v1/executor/multiproc_executor.py",
    "uniproc": "vllm/v1/executor/uniproc_executor.py",
    "loader": "vllm/model_executor/model_loader/default_loader.py",
    "reload": "vllm/model_executor/model_loader/reload/inplace.py",
    **{cls: cls.rsplit(".", 1)[0].replace(".", "/") + ".py" for cls in LOADING_TRANSFER_ENGINES},
}


@pytest.fixture(scope="module")
def releases() -> dict[str, dict[str, str]]:
    members = list(FILES.values())
    sources = {"installed": {m: wheels.installed_source(m)[1] for m in members}}
    try:
        index, _ = wheels.fetch_index()
        for release in wheels.list_releases(index):
            sources[release.version] = wheels.release_sources(release, members)
    except wheels.Offline as err:
        if os.environ.get("CI"):
            pytest.fail(str(err))
        pytest.skip(f"no network and nothing cached: {err}")
    return sources


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
