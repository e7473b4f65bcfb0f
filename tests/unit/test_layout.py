"""The package layout keeps vLLM's split: the scheduler side and the worker
side import each other only through the shared modules, and the scheduler
process never loads LMCache or NIXL."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "vllm_kvbm"
SHARED = {
    "vllm_kvbm.config",
    "vllm_kvbm.keys",
    "vllm_kvbm.messages",
    "vllm_kvbm.engine_info",
    "vllm_kvbm.metrics",
    "vllm_kvbm.tiers.page_format",
    "vllm_kvbm.tiers.page_names",
    "vllm_kvbm.tiers.page_seal",
    "vllm_kvbm.cpus",
    "vllm_kvbm.identity",
    "vllm_kvbm.identity_fields",
    "vllm_kvbm.identity_tables",
    "vllm_kvbm.identity_tables.rules",
    "vllm_kvbm.identity_tables.engine",
    "vllm_kvbm.identity_tables.kernels",
    "vllm_kvbm.canonical_values",
    "vllm_kvbm.fingerprints",
}
# The tier modules the scheduler process loads: the interfaces, the registry
# (which imports stores and views by name, when a tier is opened), the
# reconnect policy, and each medium's view with what it needs. Every other
# module under tiers/ (the stores and what they use) is worker side.
SCHEDULER_TIERS = {
    "vllm_kvbm.tiers",
    "vllm_kvbm.tiers.base",
    "vllm_kvbm.tiers.registry",
    "vllm_kvbm.tiers.reconnect",
    "vllm_kvbm.tiers.disk",
    "vllm_kvbm.tiers.disk.view",
    "vllm_kvbm.tiers.lm",
    "vllm_kvbm.tiers.lm.view",
    "vllm_kvbm.tiers.lm.protocol",
    "vllm_kvbm.tiers.redis",
    "vllm_kvbm.tiers.redis.view",
    "vllm_kvbm.tiers.redis.connection",
    "vllm_kvbm.tiers.pool",
    "vllm_kvbm.tiers.pool.view",
    "vllm_kvbm.tiers.pool.layout",
    "vllm_kvbm.tiers.pool.pool_file",
    "vllm_kvbm.tiers.peer",
    "vllm_kvbm.tiers.peer.view",
    "vllm_kvbm.tiers.peer.protocol",
    "vllm_kvbm.tiers.peer.control",
    "vllm_kvbm.tiers.peer.directory",
}


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("vllm_kvbm")}


def side_imports(side: str) -> dict[str, set[str]]:
    return {str(p.relative_to(PKG)): imports(p) for p in (PKG / side).rglob("*.py")}


def foreign(names: set[str], own: str) -> set[str]:
    """``names`` outside ``own``, the shared modules (config is a package of
    them) and the scheduler-side tier modules."""
    return (
        {n for n in names if not n.startswith((own, "vllm_kvbm.config."))}
        - SHARED
        - SCHEDULER_TIERS
    )


def module_name(path: str) -> str:
    name = "vllm_kvbm." + path.removesuffix(".py").replace("/", ".")
    return name.removesuffix(".__init__")


def test_scheduler_side_imports_only_itself_and_the_shared_modules():
    for module, names in side_imports("scheduler").items():
        other = foreign(names, "vllm_kvbm.scheduler")
        assert not other, f"scheduler/{module} imports {other}"


def test_scheduler_side_tier_modules_import_no_store():
    """A medium's view, the registry and the interfaces import only each other
    and the shared modules: importing a view never imports its store."""
    modules = {module_name(m): names for m, names in side_imports("tiers").items()}
    assert SCHEDULER_TIERS <= set(modules), SCHEDULER_TIERS - set(modules)
    for module in SCHEDULER_TIERS:
        other = foreign(modules[module], module)
        assert not other, f"{module} imports {other}"


def test_each_medium_folder_has_a_view_and_a_store_in_the_registry():
    from vllm_kvbm.tiers import registry

    media = [registry.POOL, registry.DISK, registry.PEER, *registry.REMOTE.values()]
    folders = {p.parent.name for p in (PKG / "tiers").glob("*/__init__.py")}
    assert folders == {"pool", "disk", "lm", "redis", "peer"}
    for folder in folders:
        view = f"vllm_kvbm.tiers.{folder}.view"
        store = f"vllm_kvbm.tiers.{folder}.store"
        assert view in SCHEDULER_TIERS and store not in SCHEDULER_TIERS
        assert any(
            m.view.startswith(view + ":") and m.store.startswith(store + ":") for m in media
        ), folder


def test_worker_side_imports_no_scheduler_module():
    for module, names in side_imports("worker").items():
        assert not {n for n in names if n.startswith("vllm_kvbm.scheduler")}, module


def test_tiers_import_neither_side():
    for module, names in side_imports("tiers").items():
        assert not {
            n for n in names if n.startswith(("vllm_kvbm.scheduler", "vllm_kvbm.worker"))
        }, module


def test_scheduler_process_loads_neither_lmcache_nor_nixl(tmp_path):
    """A scheduler-role connector with every tier configured, on vLLM's real
    Scheduler, in a fresh interpreter."""
    code = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parents[1])!r})
from helpers.scheduler_harness import make_scheduler
s = make_scheduler(disk_cache_dir={str(tmp_path)!r}, disk_cache_size="64MiB",
                   remote_url="lm://127.0.0.1:9", pool_cache_size="64MiB",
                   pool_dir={str(tmp_path)!r})
assert s.connector.sched is not None
print(sorted(m for m in sys.modules if m.split(".")[0] in ("lmcache", "nixl", "nixl_cu12",
                                                           "nixl_cu13", "vllm_kvbm")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = eval(out.stdout.strip().splitlines()[-1])
    assert "vllm_kvbm.scheduler.planner" in loaded
    assert not [m for m in loaded if m.startswith(("lmcache", "nixl", "vllm_kvbm.worker"))], loaded
    assert "vllm_kvbm.tiers.lm.view" in loaded and "vllm_kvbm.tiers.disk.view" in loaded
    assert "vllm_kvbm.tiers.pool.view" in loaded
    tiers = {m for m in loaded if m.startswith("vllm_kvbm.tiers")}
    assert tiers <= SCHEDULER_TIERS | SHARED, tiers - SCHEDULER_TIERS - SHARED


def test_test_files_have_unique_names():
    """pytest imports test files by basename (no __init__.py in the tiers'
    folders): two files of one name in tests/unit and tests/e2e stop the run."""
    tests = Path(__file__).resolve().parents[1]
    names = [p.name for p in tests.rglob("test_*.py")]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []


def test_every_python_file_is_at_most_500_lines():
    """Modules stay small enough to read whole: a file past 500 lines (as
    `ruff format` writes it) is split where the split is natural."""
    root = PKG.parent
    files = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=root, capture_output=True, text=True, check=True
    ).stdout.split()
    assert len(files) > 100, files  # the repository's files, not an empty listing
    long = {f: n for f in files if (n := len((root / f).read_text().splitlines())) > 500}
    assert not long, long
