"""What benchmarks/gpu_check.py's cases share: page geometries, the report, a worker driven as vLLM drives it.

Every row is printed and flushed as it is made, so a run cut short (a
timeout, a crash, a lost machine) still leaves every row it produced.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from helpers.kv_layouts import KVLayout, agent_name
from vllm_kvbm.engine_info import EngineInfo
from vllm_kvbm.keys import KeyNamespace
from vllm_kvbm.messages import KVBMConnectorMetadata, TransferJob
from vllm_kvbm.worker.worker import KVBMWorker


@dataclass(frozen=True)
class Geometry:
    """A KV cache's page geometry (K and V, every layer, one page)."""

    layers: int
    kv_heads: int
    head_size: int
    block_size: int  # tokens per vLLM block
    page_blocks: int  # blocks per page
    dtype_bytes: int = 2  # bf16
    mla: bool = False  # one latent per token (kv_heads 1), no separate V

    @property
    def block_bytes(self) -> int:
        per_token = (1 if self.mla else 2) * self.kv_heads * self.head_size * self.dtype_bytes
        return self.layers * per_token * self.block_size

    @property
    def page_bytes(self) -> int:
        return self.block_bytes * self.page_blocks

    @property
    def page_tokens(self) -> int:
        return self.block_size * self.page_blocks

    def gpu_bytes(self, pages: int) -> int:
        """KV the pages case allocates: the stored pages and as many to load into."""
        return 2 * pages * self.page_bytes


# Llama-3-70B (and 3.1/3.3): 80 layers, 8 KV heads of 128, bf16; vLLM's
# CUDA block size 16; 256-token pages.
GEOMETRY_70B = Geometry(layers=80, kv_heads=8, head_size=128, block_size=16, page_blocks=16)
# DeepSeek-V2-Lite: 27 MLA layers, one latent of kv_lora_rank 512 + qk_rope_head_dim 64, bf16.
GEOMETRY_V2_LITE = Geometry(
    layers=27, kv_heads=1, head_size=576, block_size=16, page_blocks=1, mla=True
)
# Cases run at a model's geometry instead of the command line's.
CASE_GEOMETRY = {"mla-v2-lite": GEOMETRY_V2_LITE}


@dataclass
class Report:
    """Each row is printed and flushed as it is made: a run cut short (a
    timeout, a crash, a lost machine) still leaves every row it produced."""

    rows: list[tuple[str, str, str, str]] = field(default_factory=list)

    def _add(self, row: tuple[str, str, str, str]) -> None:
        self.rows.append(row)
        print(f"{row[0]:<15} {row[1]:<48} {row[2]:<5} {row[3]}", flush=True)

    def check(self, case: str, what: str, ok: bool, detail: str) -> bool:
        self._add((case, what, "PASS" if ok else "FAIL", detail))
        return ok

    def info(self, case: str, what: str, detail: str) -> None:
        self._add((case, what, "info", detail))

    @property
    def failed(self) -> int:
        return sum(r[2] == "FAIL" for r in self.rows)

    @property
    def passed(self) -> int:
        return sum(r[2] == "PASS" for r in self.rows)


class Worker:
    """A KVBMWorker driven as vLLM drives it, with its metadata summed."""

    def __init__(
        self,
        lay: KVLayout,
        num_slots: int,
        block_size: int,
        timeout_s: float,
        page_blocks: int = 1,
        step_s: float = 0.005,
        **info,
    ):
        """``info``: EngineInfo's further fields (a hybrid model's groups)."""
        bb = lay.block_bytes()
        ns = KeyNamespace(
            model="gpu-check@",
            dtype="torch.bfloat16",
            kv_layout="check",
            block_size=block_size,
            page_blocks=page_blocks,
            page_bytes=bb * page_blocks,
            tp_size=1,
        )
        self.w = KVBMWorker(
            EngineInfo(block_size, bb, lay.num_layers, 1, ns, page_blocks, **info),
            num_slots,
            "UCX",
            agent_name("kvbm-gpu-check"),
        )
        self.w.register_kv_caches(lay.caches, lay.num_blocks, lay.block_dims)
        self.done: Counter = Counter()
        self.failed: Counter = Counter()
        self.recving: set[str] = set()
        self.timeout_s = timeout_s
        self.step_s = step_s
        self._ids = iter(range(1, 10**9))

    def step(self) -> None:
        _, recving = self.w.get_finished(set())
        self.recving |= recving
        m = self.w.build_worker_meta()
        if m is not None:
            self.done.update(m.stores_done)
            self.failed.update(m.stores_failed)
            self.failed.update(m.loads_failed)

    def until(self, cond) -> float:
        """Steps until ``cond``, one step per ``step_s`` as vLLM's engine loop
        polls (a tight loop would show progress the engine never gives)."""
        start = time.perf_counter()
        self.step()
        while not cond():
            if time.perf_counter() - start > self.timeout_s:
                raise TimeoutError("transfers did not finish")
            time.sleep(self.step_s)
            self.step()
        return time.perf_counter() - start

    def store(self, blocks: list[int], slots: list[int]) -> int:
        job = next(self._ids)
        self.w.start_stores(KVBMConnectorMetadata(stores=[TransferJob(job, "r", blocks, slots)]))
        return job

    def load(self, blocks: list[int], slots: list[int]) -> str:
        req = f"load-{next(self._ids)}"
        self.w.start_loads(KVBMConnectorMetadata(loads=[TransferJob(0, req, blocks, slots)]))
        return req


def delay(device: torch.device, seconds: float) -> None:
    """Keeps the stream busy for about ``seconds`` before the next kernel."""
    if device.type == "cuda" and seconds > 0:
        torch.cuda._sleep(int(seconds * 2e9))  # cycles; ~1-2 GHz clocks


def rewrite_kv(lay: KVLayout, step: int) -> None:
    """The 'forward pass': a kernel that rewrites every byte of the KV cache."""
    u8 = lay.raw[0].view(torch.uint8)
    u8.bitwise_xor_(step * 37 % 255 + 1)  # never 0: every byte changes


def slot_pages_equal(
    pool: torch.Tensor,
    lay: KVLayout,
    kv_cpu: list[torch.Tensor],
    blocks: list[int],
    slots: list[int],
) -> int:
    """How many of ``blocks`` are NOT byte-equal in their host slot."""
    return sum(not torch.equal(pool[s], lay.slot_bytes(b, kv_cpu)) for b, s in zip(blocks, slots))
