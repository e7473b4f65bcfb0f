"""The "paths-70b" cases of benchmarks/gpu_check.py: both copy paths side by side.

At a 70B model's geometry on one rank of TP=1 and of TP=8 (80 layers, 8 or 1
KV heads of 128, bf16, 16-token blocks, 256-token pages), whole pages are
stored into a pinned host pool (worker/host_pool.py) and loaded back into
other blocks by the copy engines (worker/copy_engine.py: KVBM's path on
CUDA) and by NIXL (a UCX agent copying to itself), each polled at an engine
step's cadence, against PyTorch's pinned ``copy_`` of as many bytes; for
vLLM's default layout (LBNHC: layer by layer) and the block-major one KVBM
asks vLLM for (BLHNC: a page of consecutive blocks is one copy). UCX's protocol choice
(``UCX_PROTO_INFO=y``) is printed, and an emulated protocol said as such.
``report_bandwidth`` gives the other cases' offload and onboard rows: through
the real worker, against ``copy_``.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time

import torch

from gpu_check_gds import sync
from helpers.kv_layouts import agent_name, vllm_layout
from vllm_kvbm.bench.cores import teed_output
from vllm_kvbm.engine_info import BLOCK_MAJOR_LAYOUT
from vllm_kvbm.worker.copy_path import nixl_page_copies
from vllm_kvbm.worker.host_pool import HostPool

PAGE_BLOCKS = 16
LAYOUTS = ("LBNHC", BLOCK_MAJOR_LAYOUT)
TARGET_RATIO = 0.9  # of a pinned copy_: what the copy-engine path must reach


def torch_copy_seconds(nbytes: int, device: torch.device, repeats: int) -> tuple[float, float]:
    """Best seconds of one pinned copy_ of ``nbytes`` device -> host and back."""
    pin = device.type == "cuda"
    host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pin)  # touched: no page faults
    dev = torch.ones(nbytes, dtype=torch.uint8, device=device)
    best_off = best_on = float("inf")
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        host.copy_(dev, non_blocking=pin)
        sync(device)
        best_off = min(best_off, time.perf_counter() - t)
        t = time.perf_counter()
        dev.copy_(host, non_blocking=pin)
        sync(device)
        best_on = min(best_on, time.perf_counter() - t)
    return best_off, best_on


def report_bandwidth(report, name: str, wk, src: list[int], dst: list[int], slots: list[int],
                     nbytes: int, device: torch.device, repeats: int) -> None:
    """Offload ``src`` into ``slots`` and onboard them into ``dst``, best of
    ``repeats``, against PyTorch's pinned copy_ of as many bytes."""
    off_s = on_s = float("inf")
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        job = wk.store(src, slots)
        wk.until(lambda: wk.done[job] or wk.failed[job])
        off_s = min(off_s, time.perf_counter() - t)
        t = time.perf_counter()
        req = wk.load(dst, slots)
        wk.until(lambda: req in wk.recving)
        on_s = min(on_s, time.perf_counter() - t)
    ref_off, ref_on = torch_copy_seconds(nbytes, device, repeats)
    report.info(name, "offload d2h GB/s (KVBM / torch copy_)",
                f"{nbytes / off_s / 1e9:.1f} / {nbytes / ref_off / 1e9:.1f} "
                f"({ref_off / off_s:.0%} of torch)")
    report.info(name, "onboard h2d GB/s (KVBM / torch copy_)",
                f"{nbytes / on_s / 1e9:.1f} / {nbytes / ref_on / 1e9:.1f} "
                f"({ref_on / on_s:.0%} of torch)")


def timed(mover, to_host: bool, blocks: list[int], rows: list[int], step_s: float,
          timeout_s: float) -> tuple[str, float]:
    """Posts one transfer and polls it once per engine step: (state, seconds)."""
    start = time.perf_counter()
    handle = mover.post(to_host, blocks, rows)
    while (state := mover.poll(handle)) == "PROC":
        if time.perf_counter() - start > timeout_s:
            return "TIMEOUT", float("inf")
        time.sleep(step_s)
    return state, time.perf_counter() - start


def ucx_protocols(text: str) -> list[tuple[str, list[str]]]:
    """UCX's protocol tables (UCX_PROTO_INFO=y): (operation, its size ranges
    as "range description (transport)"), for remote reads and writes."""
    ops: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if "|" not in line:
            continue
        cells = [c.strip() for c in line[line.index("|"):].strip().strip("|").split("|")]
        if len(cells) == 1 and "cfg#" not in cells[0]:
            ops.append((cells[0], []))
        elif len(cells) == 3 and ops and cells[0] != "Range":
            ops[-1][1].append(f"{cells[0]} {cells[1]} ({cells[2]})")
    return [(op, ranges) for op, ranges in ops if op.startswith("remote memory")]


def _size(token: str) -> int:
    """UCX's range bounds: 8184, 4G, 512K."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    return int(token[:-1]) * units[token[-1]] if token[-1] in units else int(token)


def ucx_protocol_rows(report, name: str, text: str, largest: int) -> None:
    """The RMA protocols UCX chose, and whether the copies here (at most
    ``largest`` bytes each) fall in a software-emulated range."""
    ops = ucx_protocols(text)
    for op, ranges in ops:
        report.info(name, "UCX protocol", f"{op}: {'; '.join(ranges)}")
    if not ops:
        report.info(name, "UCX protocol", "UCX printed no protocol selection (UCX_PROTO_INFO "
                    "unknown to this UCX)")
    emulated = [(op, r) for op, ranges in ops for r in ranges if "emulation" in r]
    used = [f"{op}: {r}" for op, r in emulated if _size(r.split("..")[0]) <= largest]
    later = f"; from {emulated[0][1].split('..')[0]} bytes on it would be" if emulated else ""
    report.info(name, "UCX protocol emulated",
                f"YES for these copies (UCX stages them itself, not the copy engine): {used[0]}"
                if used else f"not for these copies (at most {largest} bytes){later}")


def _movers(lay, pool, device: torch.device):
    """(label, factory) of each path this device has."""
    from vllm_kvbm.worker.page_mover import PageMover

    cuda = device.type == "cuda"
    out = []
    if cuda:
        from vllm_kvbm.worker.copy_engine import CopyEngineMover

        out.append(("copy engine", lambda: CopyEngineMover(
            lay.caches, lay.num_blocks, pool, lay.block_dims, page_blocks=PAGE_BLOCKS)))
    out.append(("NIXL", lambda: PageMover(lay.caches, lay.num_blocks, pool,
                                          name=agent_name("kvbm-paths"),
                                          block_dims=lay.block_dims)))
    return out


def run_paths(args, device: torch.device, report, tp: int, deadline: float) -> None:
    name = f"paths-70b-tp{tp}"
    cuda = device.type == "cuda"
    if not cuda:
        report.info(name, "copy engine", "skipped: no CUDA device (CPU run: NIXL only)")
    n = args.paths_pages
    nb = n * PAGE_BLOCKS
    for layout in LAYOUTS:
        lay = vllm_layout(layout, args.layers_70b, 2 * nb, heads=8 // tp, block_size=16,
                          head_size=128, gen=None, dtype=torch.bfloat16, device=device, pad=0)
        lay.raw[0].view(torch.uint8).random_(0, 256)
        bb = lay.block_bytes()
        nbytes = nb * bb
        host = HostPool(nb, bb, pin=cuda, device=device)
        ref_off, ref_on = torch_copy_seconds(nbytes, device, args.repeats)
        report.info(name, f"{layout} geometry", f"{args.layers_70b} layers, {8 // tp} KV heads "
                    f"of 128: {bb / 2**20:.2f} MiB blocks, {n} pages = {nbytes / 2**20:.0f} MiB "
                    f"per transfer; pinned copy_ {nbytes / ref_off / 1e9:.1f} GB/s d2h, "
                    f"{nbytes / ref_on / 1e9:.1f} h2d")
        src, dst = list(range(nb)), list(range(nb, 2 * nb))
        try:
            for label, make in _movers(lay, host.tensor, device):
                if time.perf_counter() > deadline:
                    report.info(name, f"{layout} {label}", "skipped: the time budget is spent")
                    continue
                run_one(args, report, name, f"{layout} {label}", make, lay, src, dst,
                        nbytes, (ref_off, ref_on), deadline)
        finally:
            host.release()
            del lay
            if cuda:
                torch.cuda.empty_cache()


def run_one(args, report, name: str, what: str, make, lay, src, dst, nbytes: int,
            ref: tuple[float, float], deadline: float) -> None:
    nixl = what.endswith("NIXL")
    ucx_log = tempfile.NamedTemporaryFile(prefix="kvbm-ucx-", suffix=".log", delete=False)
    ucx_log.close()
    saved = os.environ.get("UCX_PROTO_INFO")
    if nixl and saved is None:
        os.environ["UCX_PROTO_INFO"] = "y"  # read when the agent's UCX context starts
    best, ok = [float("inf"), float("inf")], True
    # UCX writes its protocol tables from C: what the process writes goes to the log too
    with teed_output(ucx_log.name) if nixl else contextlib.nullcontext():
        mover = make()
        try:
            for _ in range(args.repeats):
                for i, (to_host, blocks) in enumerate(((True, src), (False, dst))):
                    sync(lay.raw[0].device)
                    left = max(1.0, min(args.timeout, deadline - time.perf_counter()))
                    state, secs = timed(mover, to_host, blocks, src, args.step_s, left)
                    ok &= state == "DONE"
                    best[i] = min(best[i], secs)
        finally:
            mover.close()
            if nixl and saved is None:
                os.environ.pop("UCX_PROTO_INFO", None)
    copies = getattr(mover, "page_copies", None) or nixl_page_copies(mover.regions, PAGE_BLOCKS)
    report.info(name, f"{what} copies", str(copies))
    kv = lay.raw[0].cpu()
    equal = all(torch.equal(lay.slot_bytes(d, [kv]), lay.slot_bytes(s, [kv]))
                for s, d in ((src[0], dst[0]), (src[-1], dst[-1])))
    report.check(name, f"{what} pages stored and loaded back, bytes equal", ok and equal,
                 "first and last block compared" if ok else "a transfer did not complete")
    ratios = [r / b for r, b in zip(ref, best)]
    for i, direction in enumerate(("offload d2h", "onboard h2d")):
        report.info(name, f"{what} {direction} GB/s (vs copy_)",
                    f"{nbytes / best[i] / 1e9:.1f} / {nbytes / ref[i] / 1e9:.1f} "
                    f"({ratios[i]:.2f}x)")
    if what.endswith("copy engine"):
        met = min(ratios) >= TARGET_RATIO
        report.info(name, f"{what} at {TARGET_RATIO}x of copy_", "met" if met else
                    f"NOT met ({min(ratios):.2f}x)")
    with open(ucx_log.name, errors="replace") as f:
        ucx_text = f.read()
    os.unlink(ucx_log.name)
    if nixl:
        ucx_protocol_rows(report, name, ucx_text,
                          max(r.layer_block_bytes for r in mover.regions))  # a descriptor each
