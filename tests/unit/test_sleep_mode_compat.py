"""Where KVBM follows vLLM's sleep mode, in every supported vLLM release
(their sources read out of the PyPI wheels, tools/vllm_wheels.py): the
worker methods and arguments worker/sleep_mode.py wraps, the executor calls
that send them, the connector hooks vLLM >= 0.33 calls around the memory,
and the engine's one path to the reset of a pause that
scheduler/cache_reset.py recognises."""

from __future__ import annotations

import ast

import pytest

from test_weight_watch_compat import _by_release

CORE = "vllm/v1/engine/core.py"
EXECUTOR = "vllm/v1/executor/abstract.py"
WORKER = "vllm/v1/worker/gpu_worker.py"
BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"


@pytest.fixture(scope="module")
def releases() -> dict[str, dict[str, str]]:
    return _by_release([CORE, EXECUTOR, WORKER, BASE])


def _functions(source: str, cls: str) -> dict[str, ast.FunctionDef]:
    [node] = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == cls]
    return {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)}


def _calls(fn: ast.FunctionDef) -> list[tuple[int, str]]:
    """(line, attribute) of each ``x.attr(...)`` call in ``fn``, in order."""
    return sorted(
        (c.lineno, c.func.attr)
        for c in ast.walk(fn)
        if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
    )


def test_the_worker_methods_sleep_mode_wraps_take_what_the_wrappers_read(releases):
    for version, files in releases.items():
        worker = _functions(files[WORKER], "Worker")
        args = {
            name: [a.arg for a in worker[name].args.args]
            for name in ("sleep", "wake_up", "discard")
        }
        assert args == {
            "sleep": ["self", "level"],
            "wake_up": ["self", "tags"],
            "discard": ["self", "tags"],
        }, version
        executor = ast.unparse(ast.parse(files[EXECUTOR]))
        assert "self.collective_rpc('sleep', kwargs=dict(level=level))" in executor, version
        assert "self.collective_rpc('wake_up', kwargs=dict(tags=tags))" in executor, version
        assert "self.collective_rpc('discard', args=(tuple(" in executor, version


def test_vllm_033_on_calls_the_connector_around_the_memory_as_the_032_wrappers_do(releases):
    for version, files in releases.items():
        if version in ("installed", "0.32.0"):
            assert "def restore_kv_caches" not in files[BASE]  # 0.32: the wrappers call
            continue
        base = _functions(files[BASE], "KVConnectorBase_V1")
        assert {"unregister_kv_caches", "restore_kv_caches"} <= set(base), version
        worker = _functions(files[WORKER], "Worker")
        for name, before in (("sleep", "suspend"), ("discard", "discard")):
            calls = _calls(worker[name])
            told = [line for line, attr in calls if attr == "unregister_kv_caches"]
            freed = [line for line, attr in calls if attr == before]
            assert told and freed and told[0] < freed[-1], (version, name)
        calls = _calls(worker["wake_up"])
        mapped = [line for line, attr in calls if attr == "resume"]
        restored = [line for line, attr in calls if attr == "restore_kv_caches"]
        assert mapped and restored and mapped[0] < restored[0], version


def test_the_engine_resets_the_connector_for_a_pause_only_once_paused(releases):
    """cache_reset.part_of_a_pause recognises EngineCore._reset_caches with
    the scheduler paused: every caller of it is a pause's end or
    release_kv_cache_memory (which requires a completed pause), and a pause
    sets the paused state before it ends."""
    for version, files in releases.items():
        source = files[CORE]
        classes = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)}
        callers = {
            f"{cls}.{fn.name}"
            for cls, node in classes.items()
            for fn in node.body
            if isinstance(fn, ast.FunctionDef)
            and any(attr == "_reset_caches" for _, attr in _calls(fn))
        }
        assert callers == {"EngineCore._finish_pause", "EngineCore.release_kv_cache_memory"}, (
            version
        )
        core = _functions(source, "EngineCore")
        assert "self.is_scheduler_paused()" in ast.unparse(core["release_kv_cache_memory"])
        assert "is_scheduler_paused" in core, version
        for cls in ("EngineCore", "EngineCoreProc"):
            # (a callback defined inside, run once the engine is idle, comes later still)
            pause = _functions(source, cls)["pause_scheduler"]
            nested = {
                id(c)
                for f in ast.walk(pause)
                if isinstance(f, ast.FunctionDef) and f is not pause
                for c in ast.walk(f)
            }
            calls = [
                c.func.attr
                for c in sorted(
                    (
                        c
                        for c in ast.walk(pause)
                        if isinstance(c, ast.Call)
                        and id(c) not in nested
                        and isinstance(c.func, ast.Attribute)
                    ),
                    key=lambda c: c.lineno,
                )
            ]
            assert "set_pause_state" in calls, (version, cls)
            if "_finish_pause" in calls:
                assert calls.index("set_pause_state") < calls.index("_finish_pause")
        sleep = ast.unparse(core["sleep"])
        assert "clear_prefix_cache = level >= 1" in sleep, version
