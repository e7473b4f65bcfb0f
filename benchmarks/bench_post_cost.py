"""Engine-thread cost of posting an 8k-token prefill's copies, against a budget.

What the engine thread spends in ``mover.post`` for a store of an 8192-token
prefill (512 blocks of 16 tokens, 32 pages of 256) at a 70B model's geometry
(80 layers, 8 KV heads of 128, bf16) on one rank of TP=1 and of TP=8, for
vLLM's default layout (LBNHC, layer by layer) and the block-major one KVBM
asks vLLM for on CUDA (BLHNC, engine_info.py):

- copy engine (worker/copy_engine.py): the copy list (numpy, merged) and the
  batch handed to the stream. The stream here is a stand-in that takes the
  batch and returns at once (no GPU): on CUDA the batch call adds one driver
  call (``cuMemcpyBatchAsync``) that returns without waiting for the copies.
- NIXL (page_mover.py): the descriptor indices and NIXL's handle for them
  (``make_prepped_xfer``), without the transfer itself (on CPU the ``self``
  transport would copy inside the post).

The engine's KV and the host pool are allocated, never touched (no RAM used
beyond page tables). Prints a row per case and the budget: a 70B decode step
takes tens of milliseconds, so posting a prefill's copies should cost well
under one: BUDGET_MS.

    .venv/bin/python benchmarks/bench_post_cost.py [--repeats 20] [--no-nixl]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import torch  # noqa: E402

from helpers.kv_layouts import agent_name, vllm_layout  # noqa: E402
from vllm_kvbm.worker.copy_engine import CopyEngineMover, CopyHandle  # noqa: E402
from vllm_kvbm.engine_info import BLOCK_MAJOR_LAYOUT  # noqa: E402

PREFILL_TOKENS = 8192
BLOCK_TOKENS = 16
PAGE_BLOCKS = 16
BUDGET_MS = 1.0


class TakesTheBatch:
    """The stream's place: takes the copy list and returns, as a CUDA batch call does."""

    name = "a stand-in stream"

    def submit(self, src, dst, sizes, to_host, after=None, timed=False):
        class Done:
            def query(self):
                return True

        return CopyHandle(Done(), (src, dst, sizes))


def median_ms(fn, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--no-nixl", action="store_true", help="the copy-engine path only")
    args = p.parse_args(argv)
    blocks = PREFILL_TOKENS // BLOCK_TOKENS
    num_blocks = 2 * blocks
    print(
        f"posting a {PREFILL_TOKENS}-token prefill's store: {blocks} blocks, "
        f"{blocks // PAGE_BLOCKS} pages; 70B geometry; budget {BUDGET_MS:g} ms on the "
        f"engine thread; median of {args.repeats}"
    )
    print(f"{'case':<22} {'path':<12} {'copies':>7} {'post ms':>8}  within budget")
    worst: dict[str, float] = {}
    for tp in (1, 8):
        for layout in ("LBNHC", BLOCK_MAJOR_LAYOUT):
            lay = vllm_layout(
                layout,
                80,
                num_blocks,
                heads=8 // tp,
                block_size=BLOCK_TOKENS,
                head_size=128,
                gen=None,
                dtype=torch.bfloat16,
                pad=0,
            )
            pool = torch.empty(blocks, lay.block_bytes(), dtype=torch.uint8)
            # the prefill's blocks: every other one (a busy engine's free list), into rows
            ids, rows = list(range(0, num_blocks, 2)), list(range(blocks))
            case = f"TP={tp} {layout}"
            m = CopyEngineMover(
                lay.caches,
                num_blocks,
                pool,
                lay.block_dims,
                copies=TakesTheBatch(),
                page_blocks=PAGE_BLOCKS,
            )
            n = len(m._runs(True, ids, rows)[2])
            ms = median_ms(lambda: m.post(True, ids, rows), args.repeats)
            worst[layout] = max(worst.get(layout, 0.0), ms)
            print(
                f"{case:<22} {'copy engine':<12} {n:>7} {ms:>8.3f}  "
                f"{'yes' if ms <= BUDGET_MS else 'NO'}",
                flush=True,
            )
            if not args.no_nixl:
                ms, n = nixl_post_ms(lay, num_blocks, pool, ids, rows, args.repeats)
                print(
                    f"{case:<22} {'NIXL':<12} {n:>7} {ms:>8.3f}  "
                    f"{'yes' if ms <= BUDGET_MS else 'NO'}",
                    flush=True,
                )
            del lay, pool
    for layout, ms in worst.items():
        print(
            f"copy engine, {layout}: at most {ms:.3f} ms per 8k-token prefill "
            f"({ms / BUDGET_MS:.2f} of the {BUDGET_MS:g} ms budget)"
        )
    return 0


def nixl_post_ms(lay, num_blocks: int, pool, ids, rows, repeats: int) -> tuple[float, int]:
    """make_prepped_xfer for the store's descriptors (and the handle's release)."""
    from vllm_kvbm.worker.page_mover import PageMover

    m = PageMover(
        lay.caches, num_blocks, pool, name=agent_name("kvbm-post-cost"), block_dims=lay.block_dims
    )
    try:

        def post():
            kv_idx, host_idx = m._indices(ids, rows)
            m.agent.make_prepped_xfer("WRITE", m._kv_side, kv_idx, m._host_side, host_idx).release()

        return median_ms(post, repeats), len(ids) * len(m.regions)
    finally:
        m.close()


if __name__ == "__main__":
    sys.exit(main())
