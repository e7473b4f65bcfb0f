"""The worker side without vLLM: every worker-side module imports, and pages
are stored and loaded, with vLLM unimportable (a GPU machine may have only
PyTorch and NIXL)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


# ---- the worker side without vLLM -----------------------------------------------


def test_worker_side_imports_and_moves_pages_without_vllm():
    """The GPU machine may have only PyTorch and NIXL: import every worker-side
    module with vLLM unimportable, then store and load pages for real."""
    tests = Path(__file__).resolve().parents[1]
    code = f"""
import importlib.abc, sys
class NoVllm(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
sys.meta_path.insert(0, NoVllm())
sys.path[:0] = [{str(tests)!r}, {str(tests.parent)!r}]
import time, torch
import vllm_kvbm.config, vllm_kvbm.keys, vllm_kvbm.engine_info, vllm_kvbm.messages
import vllm_kvbm.tiers.page_format, vllm_kvbm.tiers.page_codec, vllm_kvbm.worker.tier_io
import vllm_kvbm.worker.fence, vllm_kvbm.worker.host_pool, vllm_kvbm.worker.page_mover
import vllm_kvbm.worker.vllm_layout
from helpers.kv_layouts import agent_name, vllm_layout
from vllm_kvbm.engine_info import EngineInfo
from vllm_kvbm.keys import KeyNamespace
from vllm_kvbm.messages import KVBMConnectorMetadata, TransferJob
from vllm_kvbm.worker.worker import KVBMWorker
from vllm_kvbm.worker.vllm_layout import declared_block_dims
assert declared_block_dims(None, {{}}) is None  # no vLLM: the shapes decide
lay = vllm_layout("LBNHC", 4, 40, heads=2, block_size=4, head_size=8,
                  gen=torch.Generator().manual_seed(0))
bb = lay.block_bytes()
ns = KeyNamespace(model="m@", dtype="torch.bfloat16", kv_layout="LBNHC", block_size=4,
                  page_bytes=bb, tp_size=1)
w = KVBMWorker(EngineInfo(4, bb, 4, 1, ns), 16, "UCX", agent_name())
w.register_kv_caches(lay.caches, 40, lay.block_dims)
w.start_stores(KVBMConnectorMetadata(stores=[TransferJob(1, "A", [3, 7, 9], [0, 5, 2])]))
deadline = time.monotonic() + 10
done = 0
while not done:
    w.get_finished(set())
    m = w.build_worker_meta()
    done = m is not None and m.stores_done[1]
    assert time.monotonic() < deadline
for b, s in [(3, 0), (7, 5), (9, 2)]:
    assert torch.equal(w.host_pool[s], lay.slot_bytes(b))
w.start_loads(KVBMConnectorMetadata(loads=[TransferJob(2, "L", [20, 21], [0, 5])]))
while "L" not in w.get_finished(set())[1]:
    assert time.monotonic() < deadline
assert torch.equal(lay.slot_bytes(20), lay.slot_bytes(3))
assert torch.equal(lay.slot_bytes(21), lay.slot_bytes(7))
w.shutdown()
print("vllm modules:", sorted(m for m in sys.modules if m.split(".")[0] == "vllm"))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "vllm modules: []"
