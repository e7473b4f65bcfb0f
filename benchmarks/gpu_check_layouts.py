"""The KV layout cases of benchmarks/gpu_check.py ("packed-blhnc", "flash-attn",
"flashinfer-hnd", "mla", "kernel-split", "mla-v2-lite"): stores that must copy
the KV after the kernel that rewrites it, the control that shows the race
the fence prevents, loads that land after the kernel zeroing their blocks,
and the bandwidth of the worker's mover against ``copy_``."""

from __future__ import annotations

import time

import torch

from helpers.kv_layouts import KVLayout, vllm_layout

from gpu_check_harness import (
    CASE_GEOMETRY,
    Geometry,
    Report,
    Worker,
    delay,
    rewrite_kv,
    slot_pages_equal,
)
from gpu_check_gds import sync
from gpu_check_paths import report_bandwidth

# name -> (vLLM KVCacheLayout, MLA, kernel blocks per block)
CASES = {
    "flash-attn": ("LBNHC", False, 1),
    "flashinfer-hnd": ("LBHNC", False, 1),
    "packed-blhnc": ("BLHNC", False, 1),
    "mla": ("LBNHC", True, 1),
    "kernel-split": ("LBNHC", False, 2),
    "mla-v2-lite": ("LBNHC", True, 1),  # at its model's geometry: CASE_GEOMETRY
}


def unordered_stores(
    mover,
    lay: KVLayout,
    pool: torch.Tensor,
    blocks: list[int],
    slots: list[int],
    device: torch.device,
    args,
) -> int:
    """The control: a kernel rewrites the KV and the same store is posted at
    once on the copy engine's stream with its wait left out (the mistake the
    fence prevents); how many host pages it left stale."""
    copies = mover.copies
    copies.order = lambda stream, after: None  # waits for nothing
    try:
        delay(device, args.kernel_delay)
        rewrite_kv(lay, 2)
        handle = mover.post(True, blocks, slots)
        start = time.perf_counter()
        while mover.poll(handle) == "PROC":
            if time.perf_counter() - start > args.timeout:
                raise TimeoutError("the control's copies did not finish")
            time.sleep(0.001)
    finally:
        del copies.order  # ordered again
    sync(device)
    return slot_pages_equal(pool, lay, [lay.raw[0].cpu()], blocks, slots)


def run_case(name: str, args, device: torch.device, report: Report) -> None:
    layout, mla, split = CASES[name]
    geo = CASE_GEOMETRY.get(name) or Geometry(
        args.layers,
        1 if mla else args.heads,
        args.mla_head_size if mla else args.head_size,
        args.block_size * split,
        1,
        mla=mla,
    )
    lay = vllm_layout(
        layout,
        geo.layers,
        args.blocks,
        heads=geo.kv_heads,
        block_size=geo.block_size,
        head_size=geo.head_size,
        gen=None,
        dtype=torch.bfloat16,
        mla=mla,
        kernel_split=split,
        device=device,
        pad=4096,
    )
    lay.raw[0].view(torch.uint8).random_(0, 256)
    sync(device)
    nb, slots_n = args.blocks, args.slots
    n = min(slots_n, nb // 2)  # blocks stored; loaded back into n other blocks
    blocks = list(range(0, 2 * n, 2))
    others = list(range(1, 2 * n, 2))
    slots = list(range(n))[::-1]
    bb = lay.block_bytes()
    gib = n * bb / 1024**3
    shape = tuple(next(iter(lay.caches.values())).shape)
    report.info(
        name,
        "layout",
        f"{layout}{' MLA' if mla else ''}, {geo.layers} layers, "
        f"per-layer view {shape}, block {bb / 1024**2:.2f} MiB, {n} blocks = "
        f"{gib:.2f} GiB per transfer",
    )
    report.check(
        name,
        "block size as computed",
        bb == geo.block_bytes,
        f"{bb} bytes laid out, {geo.block_bytes} computed",
    )
    wk = Worker(lay, slots_n, geo.block_size, args.timeout, step_s=args.step_s)
    try:
        pool = wk.w.host_pool
        # the host tier's slots, then the staging slots of streamed loads
        rows = slots_n + wk.w._staging.count
        report.check(
            name,
            "host pool exact size",
            pool.untyped_storage().nbytes() == rows * bb,
            f"{pool.untyped_storage().nbytes()} bytes for {slots_n} slots + "
            f"{wk.w._staging.count} staging slots of {bb}",
        )
        if device.type == "cuda":
            report.check(
                name,
                "host pool pinned (cudaHostRegister)",
                pool.is_pinned(),
                f"is_pinned={pool.is_pinned()}",
            )
        report.info(name, "copy path", wk.w.mover.path)

        # 1. stores right after the kernel that writes the KV, with the fence
        delay(device, args.kernel_delay)
        rewrite_kv(lay, 1)
        t = time.perf_counter()
        job = wk.store(blocks, slots)  # exactly what wait_for_save does
        wk.until(lambda: wk.done[job] or wk.failed[job])
        waited = time.perf_counter() - t
        sync(device)
        kv_cpu = [lay.raw[0].cpu()]
        bad = slot_pages_equal(pool, lay, kv_cpu, blocks, slots)
        report.check(
            name,
            "stores copy the KV after the forward",
            not bad and wk.done[job],
            f"{n - bad}/{n} host pages byte-equal; done in {waited * 1e3:.0f} ms",
        )

        # control: the same copies waiting for nothing must read stale KV, or the
        # check above could not have failed
        if getattr(wk.w.mover, "orders_on_gpu", False):
            stale = unordered_stores(wk.w.mover, lay, pool, blocks, slots, device, args)
            report.info(
                name,
                "control: copies that wait for nothing",
                f"{stale}/{n} host pages stale: the race the fence prevents is real "
                f"here, so the check above can fail"
                if stale
                else f"0/{n} host pages stale: the kernel finished before the copies began, "
                f"so the check above proves less here (raise --kernel-delay)",
            )
            job = wk.store(blocks, slots)  # with the fence again: the pool holds the KV
            wk.until(lambda: wk.done[job] or wk.failed[job])
            sync(device)

        # 2. loads into other blocks right after a kernel that zeroes them
        kv_before = lay.raw[0].clone()
        want = [pool[s].clone() for s in slots]
        delay(device, args.kernel_delay)
        for b in others:
            lay.zero_block(b)
        t = time.perf_counter()
        req = wk.load(others, slots)
        wk.until(lambda: req in wk.recving)
        waited = time.perf_counter() - t
        sync(device)
        kv_cpu = [lay.raw[0].cpu()]
        bad = sum(not torch.equal(lay.slot_bytes(b, kv_cpu), w) for b, w in zip(others, want))
        # every byte outside the loaded blocks is as before
        expected = [kv_before.cpu()]
        for b, w in zip(others, want):
            off = 0
            for page in lay.pages(expected, b):
                page.copy_(w[off : off + page.numel()])
                off += page.numel()
        whole = torch.equal(kv_cpu[0], expected[0])
        report.check(
            name,
            "loads land after pending kernels",
            not bad and whole and not wk.failed,
            f"{n - bad}/{n} blocks byte-equal, rest of KV untouched: {whole}; "
            f"{waited * 1e3:.0f} ms",
        )

        # 3. bandwidth through the worker's mover against PyTorch's pinned copy_
        report_bandwidth(
            report,
            name,
            wk.w.mover,
            blocks,
            others,
            slots,
            n * bb,
            device,
            args.repeats,
            args.timeout,
        )
        report.check(name, "no transfer failed", not wk.failed, f"failed: {dict(wk.failed)}")
    finally:
        wk.w.shutdown()
        report.check(name, "shutdown released NIXL", wk.w.mover is None, "")
        del lay
