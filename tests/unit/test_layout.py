"""The package layout keeps vLLM's split: the scheduler side and the worker
side import each other only through the shared modules, and the scheduler
process never loads LMCache or NIXL."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "vllm_kvbm"
SHARED = {"vllm_kvbm.config", "vllm_kvbm.keys", "vllm_kvbm.messages", "vllm_kvbm.engine_info",
          "vllm_kvbm.metrics", "vllm_kvbm.tiers.page_format", "vllm_kvbm.tiers.lm_protocol",
          "vllm_kvbm.tiers.redis_conn", "vllm_kvbm.cpus", "vllm_kvbm.identity",
          "vllm_kvbm.identity_fields", "vllm_kvbm.fingerprints"}


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("vllm_kvbm")}


def side_imports(side: str) -> dict[str, set[str]]:
    return {str(p.relative_to(PKG)): imports(p) for p in (PKG / side).glob("*.py")}


def test_scheduler_side_imports_only_itself_and_the_shared_modules():
    for module, names in side_imports("scheduler").items():
        foreign = {n for n in names if not n.startswith("vllm_kvbm.scheduler")} - SHARED
        assert not foreign, f"scheduler/{module} imports {foreign}"


def test_worker_side_imports_no_scheduler_module():
    for module, names in side_imports("worker").items():
        assert not {n for n in names if n.startswith("vllm_kvbm.scheduler")}, module


def test_tiers_import_neither_side():
    for module, names in side_imports("tiers").items():
        assert not {n for n in names
                    if n.startswith(("vllm_kvbm.scheduler", "vllm_kvbm.worker"))}, module


def test_scheduler_process_loads_neither_lmcache_nor_nixl(tmp_path):
    """A scheduler-role connector with every tier configured, on vLLM's real
    Scheduler, in a fresh interpreter."""
    code = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parents[1])!r})
from helpers.scheduler_harness import make_scheduler
s = make_scheduler(disk_cache_dir={str(tmp_path)!r}, disk_cache_size="64MiB",
                   remote_url="lm://127.0.0.1:9")
assert s.connector.sched is not None
print(sorted(m for m in sys.modules if m.split(".")[0] in ("lmcache", "nixl", "nixl_cu12",
                                                           "nixl_cu13", "vllm_kvbm")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = eval(out.stdout.strip().splitlines()[-1])
    assert "vllm_kvbm.scheduler.planner" in loaded
    assert not [m for m in loaded if m.startswith(("lmcache", "nixl", "vllm_kvbm.worker",
                                                   "vllm_kvbm.tiers.disk",
                                                   "vllm_kvbm.tiers.remote"))], loaded
