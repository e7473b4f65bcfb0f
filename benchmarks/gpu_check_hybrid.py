"""The "hybrid" case of benchmarks/gpu_check.py: the KV cache of vLLM's hybrid allocator.

With vLLM's hybrid KV cache manager (HMA) the KV cache groups of a hybrid
model (Qwen3-Next: Gated DeltaNet state beside full attention; Gemma 3:
sliding window beside full) share one pool of blocks: a layer of each group
views the SAME tensor with the same block stride, and block b belongs to one
group at a time. A state layer's view is shorter than the block: its state is
smaller than the page, which vLLM pads to the attention layer's.

Laid out as vLLM 0.32's CPU build lays out the Qwen3-Next-shaped model of
vllm_kvbm/tools/local_model.py (3 GDN layers, then full attention; 2 KV heads of
64, 256-token blocks): the attention layer's view is ``(blocks, 2, 256, 128)``
bf16 with strides ``(65536, 32768, 128, 1)``, one block 131072 bytes; each GDN
layer's is ``(blocks, 1, 1, 68608)`` int8 with strides ``(131072, 68608, 68608,
1)`` over the same memory. With the real KVBMWorker, given an EngineInfo of one
block's bytes and the model's groups:

1. the mover has one region: each block's bytes are copied once (the longest view);
2. stores copy exactly each stored block's bytes (the state, the padding after
   it, the rest of the attention view's) into its slot, no other host row;
3. loads restore them into other blocks, every other byte of the tensor unchanged;
4. a store marked ``before_next_step`` (a window or state block, freed and
   reused as the request moves on) is finished once ``handle_preemptions``
   returns, before the step that may reuse its blocks runs.
"""

from __future__ import annotations

import time

import torch

from gpu_check_gds import sync
from gpu_check_paths import report_bandwidth
from helpers.kv_layouts import KVLayout
from vllm_kvbm.engine_info import GroupInfo
from vllm_kvbm.messages import KVBMConnectorMetadata, TransferJob

NAME = "hybrid"
STATE_LAYERS = 3  # GDN layers per attention layer, as in Qwen3-Next
# vLLM numbers a hybrid model's groups by their kind's first layer: the GDN
# layers of Qwen3-Next's first four come first, each a group of its own.
GROUPS = (*(GroupInfo(i, "state") for i in range(STATE_LAYERS)), GroupInfo(STATE_LAYERS, "full"))
PRIMARY = STATE_LAYERS  # the full-attention group: its pages carry the prefix's keys
KV_HEADS, BLOCK_TOKENS, HEAD_SIZE = 2, 256, 64  # the attention layer's, bf16
STATE_BYTES = 68608  # one GDN layer's conv and recurrent state
PAD = 4096  # guard bytes before and after the tensor: no copy may touch them


def attn_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def state_name(i: int) -> str:
    return f"model.layers.{i}.linear_attn"


def hybrid_layout(num_blocks: int, device: torch.device) -> KVLayout:
    """One int8 tensor of ``num_blocks`` blocks, three GDN layers' views and
    one attention layer's over it, in layer order (as register_kv_caches gets them)."""
    block = KV_HEADS * BLOCK_TOKENS * 2 * HEAD_SIZE * 2  # K and V, bf16
    assert STATE_BYTES <= block
    buf = torch.empty(PAD + num_blocks * block + PAD, dtype=torch.int8, device=device)

    def views(raw):  # a view per layer, as vLLM hands each layer its own
        body = raw[0][PAD : PAD + num_blocks * block]
        out = {
            state_name(i): torch.as_strided(
                body,
                (num_blocks, 1, 1, STATE_BYTES),
                (block, STATE_BYTES, STATE_BYTES, 1),
                storage_offset=body.storage_offset(),
            )
            for i in range(STATE_LAYERS)
        }
        out[attn_name(STATE_LAYERS)] = body.view(torch.bfloat16).view(
            num_blocks, KV_HEADS, BLOCK_TOKENS, 2 * HEAD_SIZE
        )
        return out

    def pages(raw, blk):  # a block is one run of bytes, whichever group holds it
        flat = raw[0].view(torch.uint8)
        return [flat[PAD + blk * block : PAD + (blk + 1) * block]]

    return KVLayout(
        num_blocks, 1, [buf], views, pages, block_dims={name: 0 for name in views([buf])}
    )


def busy(device: torch.device, seconds: float) -> None:
    """Keeps the stream busy for about ``seconds``: the next kernel runs late."""
    if device.type == "cuda" and seconds > 0:
        torch.cuda._sleep(int(seconds * 2e9))  # cycles; ~1-2 GHz clocks


def rewrite(lay: KVLayout, step: int) -> None:
    """The forward pass: a kernel that rewrites every byte of the tensor."""
    lay.raw[0].view(torch.uint8).bitwise_xor_(step * 37 % 255 + 1)  # never 0


def run_hybrid(args, device: torch.device, report, worker) -> None:
    """``worker``: gpu_check.Worker (passed in: gpu_check imports this module)."""
    nb = max(args.blocks, 4)
    lay = hybrid_layout(nb, device)
    lay.raw[0].view(torch.uint8).random_(0, 256)
    sync(device)
    n = min(args.slots or nb // 2, nb // 2)
    blocks, others = list(range(0, 2 * n, 2)), list(range(1, 2 * n, 2))
    slots = list(range(n))[::-1]
    bb = lay.block_bytes()
    caches = lay.caches
    attn, state = caches[attn_name(STATE_LAYERS)], caches[state_name(0)]
    report.info(
        NAME,
        "layout",
        f"{nb} blocks of {bb} bytes: attention view {tuple(attn.shape)} "
        f"bf16 strides {attn.stride()}, {STATE_LAYERS} state views {tuple(state.shape)} "
        f"int8 strides {state.stride()}; groups {[g.kind for g in GROUPS]}, "
        f"primary {PRIMARY}",
    )
    shared = {v.data_ptr() for v in caches.values()} == {attn.data_ptr()} and {
        v.stride(0) * v.element_size() for v in caches.values()
    } == {bb}
    report.check(
        NAME,
        "every group's layer views one tensor",
        shared,
        "same data_ptr and block stride in bytes",
    )
    wk = worker(
        lay, n, BLOCK_TOKENS, args.timeout, step_s=args.step_s, groups=GROUPS, primary=PRIMARY
    )
    try:
        got = [(r.stride, r.layer_block_bytes) for r in wk.w.mover.regions]
        report.check(
            NAME,
            "one region: each block copied once",
            wk.w.info.hybrid and got == [(bb, bb)],
            f"{len(got)} region(s) for {len(caches)} layer views: {got} (stride, bytes)",
        )
        pool = wk.w.host_pool
        rows = n + wk.w._staging.count
        report.check(
            NAME,
            "host pool exact size",
            pool.untyped_storage().nbytes() == rows * bb,
            f"{pool.untyped_storage().nbytes()} bytes for {rows} rows of {bb}",
        )
        report.info(NAME, "copy path", wk.w.mover.path)

        # 1. stores: each block's bytes, whole, into its slot and nowhere else
        pool.random_(0, 256)
        pool_before = pool.clone()
        busy(device, args.kernel_delay)
        rewrite(lay, 1)
        job = wk.store(blocks, slots)
        wk.until(lambda: wk.done[job] or wk.failed[job])
        sync(device)
        kv = [lay.raw[0].cpu()]
        bad = sum(not torch.equal(pool[s], lay.slot_bytes(b, kv)) for b, s in zip(blocks, slots))
        rest = sorted(set(range(rows)) - set(slots))
        untouched = torch.equal(pool[rest], pool_before[rest])
        report.check(
            NAME,
            "stores copy each block's bytes exactly",
            not bad and untouched and wk.done[job] > 0,
            f"{n - bad}/{n} host pages byte-equal ({bb} bytes: {STATE_BYTES} of state, "
            f"then padding), the other {len(rest)} host rows untouched: {untouched}",
        )
        bad = sum(
            not torch.equal(
                pool[s][:STATE_BYTES].view(torch.int8), caches[state_name(i)][b].reshape(-1).cpu()
            )
            for b, s in zip(blocks, slots)
            for i in range(STATE_LAYERS)
        )
        report.check(
            NAME,
            "state views' bytes in the pages",
            not bad,
            f"{STATE_LAYERS * n - bad}/{STATE_LAYERS * n} (block, GDN layer) states byte-equal",
        )
        del kv

        # 2. loads into other blocks: the tensor's other bytes (guards included) unchanged
        kv_before = lay.raw[0].to("cpu", copy=True)
        want = [pool[s].clone() for s in slots]
        busy(device, args.kernel_delay)
        for b in others:
            lay.zero_block(b)
        req = wk.load(others, slots)
        wk.until(lambda: req in wk.recving)
        sync(device)
        expected = kv_before.clone()
        for b, w in zip(others, want):
            lay.pages([expected], b)[0].copy_(w)
        whole = torch.equal(lay.raw[0].cpu(), expected)
        report.check(
            NAME,
            "loads restore blocks, the rest unchanged",
            whole and not wk.failed,
            f"{n} blocks of {bb} bytes loaded; the tensor equals the expected: {whole}",
        )
        del kv_before, expected, want

        # 3. a before_next_step store is finished when handle_preemptions returns,
        # without get_finished polling it
        busy(device, args.kernel_delay)
        rewrite(lay, 2)
        job = next(wk._ids)
        wk.w.start_stores(
            KVBMConnectorMetadata(
                stores=[TransferJob(job, "r", blocks, slots, before_next_step=True)]
            )
        )
        t = time.perf_counter()
        wk.w.handle_preemptions(KVBMConnectorMetadata())
        waited = time.perf_counter() - t
        left = [x for x in [*wk.w._pending, *wk.w._inflight] if x.job.job_id == job]
        done = wk.w._meta.stores_done[job]
        kv = [lay.raw[0].cpu()]
        bad = sum(not torch.equal(pool[s], lay.slot_bytes(b, kv)) for b, s in zip(blocks, slots))
        report.check(
            NAME,
            "handle_preemptions waits for before_next_step",
            not left and done > 0 and not bad,
            f"{len(left)} still queued or in flight, reported done: {done > 0}, "
            f"{n - bad}/{n} host pages byte-equal; waited {waited * 1e3:.0f} ms",
        )
        del kv
        wk.step()

        report_bandwidth(
            report,
            NAME,
            wk.w.mover,
            blocks,
            others,
            slots,
            n * bb,
            device,
            args.repeats,
            args.timeout,
        )
        report.check(NAME, "no transfer failed", not wk.failed, f"failed: {dict(wk.failed)}")
    finally:
        wk.w.shutdown()
        report.check(NAME, "shutdown released NIXL", wk.w.mover is None, "")
        del lay
