"""The copy paths' speed in benchmarks/gpu_check.py, each timed the way it can be timed exactly.

"paths-70b-tp1" and "-tp8": the copy engines (worker/copy_engine.py: KVBM's
path on CUDA) at a 70B model's geometry on one rank of TP=1 and of TP=8 (80
layers, 8 or 1 KV heads of 128, bf16, 16-token blocks, 256-token pages),
the same bytes at both (TP=8's blocks are 8 times smaller: it moves 8 times
the pages). Whole pages are stored into a pinned host pool
(worker/host_pool.py) and loaded back into other blocks, against PyTorch's
pinned ``copy_`` of as many bytes; both are timed by CUDA events around the
copies on their stream (the copy engine records them around its batch), so
neither includes host polling. BLHNC, the layout KVBM asks vLLM for (a page
of consecutive blocks is one copy), first; then vLLM's default LBNHC.

"nixl-70b-tp1" and "-tp8": the same through NIXL (a UCX agent copying to
itself), last, each layout on its own (an exception ends only its rows).
NIXL takes no stream: it is timed by perf_counter from the post until it is
polled done, without sleeping between polls. UCX's protocol choice
(``UCX_PROTO_INFO=y``) is printed, an emulated protocol said as such. A
transfer still in flight at its timeout leaves its agent open (closing it
under a running UCX transfer crashes UCX).

``report_bandwidth`` gives the other cases' offload and onboard rows through
the worker's own mover, timed the same way.
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
LAYOUTS = (BLOCK_MAJOR_LAYOUT, "LBNHC")  # what KVBM asks for first
TARGET_RATIO = 0.9  # of a pinned copy_: what the copy-engine path must reach
# What a transfer still running at its timeout may write: kept to process exit.
_KEPT: list = []
EVENTS = "CUDA events"
UNTIL_DONE = "perf_counter, polled until done"


def copy_seconds(nbytes: int, device: torch.device, repeats: int) -> tuple[float, float]:
    """Best seconds of one pinned copy_ of ``nbytes`` device -> host and back
    (CUDA events around each on CUDA)."""
    cuda = device.type == "cuda"
    host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=cuda)  # touched: no page faults
    dev = torch.ones(nbytes, dtype=torch.uint8, device=device)
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for i, (dst, src) in enumerate(((host, dev), (dev, host))):
            sync(device)
            if cuda:
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                dst.copy_(src, non_blocking=True)
                end.record()
                end.synchronize()
                secs = start.elapsed_time(end) / 1e3
            else:
                t = time.perf_counter()
                dst.copy_(src)
                secs = time.perf_counter() - t
            best[i] = min(best[i], secs)
    return best[0], best[1]


def timing_of(mover) -> str:
    return EVENTS if getattr(mover, "orders_on_gpu", False) else UNTIL_DONE


def mover_seconds(
    mover, to_host: bool, blocks: list[int], rows: list[int], timeout_s: float
) -> tuple[str, float]:
    """One transfer: (state, seconds). The copy engines' own events give
    their time on the GPU; NIXL's is from the post until polled done.
    "PROC": still running at the timeout (it may still write)."""
    events = getattr(mover, "orders_on_gpu", False)
    start = time.perf_counter()
    handle = (
        mover.post(to_host, blocks, rows, timed=True)
        if events
        else mover.post(to_host, blocks, rows)
    )
    while (state := mover.poll(handle)) == "PROC":
        if time.perf_counter() - start > timeout_s:
            return "PROC", float("inf")
        time.sleep(0.0002 if events else 0)  # events time the GPU; NIXL is polled flat out
    elapsed = time.perf_counter() - start
    if state != "DONE":
        return state, float("inf")
    return state, handle.seconds() if events else elapsed


def report_bandwidth(
    report,
    name: str,
    mover,
    src: list[int],
    dst: list[int],
    slots: list[int],
    nbytes: int,
    device: torch.device,
    repeats: int,
    timeout_s: float = 60.0,
) -> bool:
    """Offload ``src`` into ``slots`` and onboard them into ``dst`` through
    ``mover``, best of ``repeats``, against copy_ of as many bytes. False if a
    transfer is still running (its memory must stay registered)."""
    best = [float("inf"), float("inf")]
    states = set()
    for _ in range(repeats):
        for i, (to_host, blocks) in enumerate(((True, src), (False, dst))):
            sync(device)
            state, secs = mover_seconds(mover, to_host, blocks, slots, timeout_s)
            states.add(state)
            best[i] = min(best[i], secs)
            if state == "PROC":
                report.check(
                    name,
                    "bandwidth transfers finished",
                    False,
                    f"a transfer still running after {timeout_s:g} s",
                )
                return False
    report.check(name, "bandwidth transfers finished", states == {"DONE"}, f"{sorted(states)}")
    ref = copy_seconds(nbytes, device, repeats)
    for i, what in enumerate(("offload d2h", "onboard h2d")):
        report.info(
            name,
            f"{what} GB/s (KVBM / torch copy_)",
            f"{nbytes / best[i] / 1e9:.1f} / {nbytes / ref[i] / 1e9:.1f} "
            f"({ref[i] / best[i]:.0%} of torch; {timing_of(mover)})",
        )
    return True


def ucx_protocols(text: str) -> list[tuple[str, list[str]]]:
    """UCX's protocol tables (UCX_PROTO_INFO=y): (operation, its size ranges
    as "range description (transport)"), for remote reads and writes."""
    ops: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if "|" not in line:
            continue
        cells = [c.strip() for c in line[line.index("|") :].strip().strip("|").split("|")]
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
        report.info(
            name,
            "UCX protocol",
            "UCX printed no protocol selection (UCX_PROTO_INFO unknown to this UCX)",
        )
    emulated = [(op, r) for op, ranges in ops for r in ranges if "emulation" in r]
    used = [f"{op}: {r}" for op, r in emulated if _size(r.split("..")[0]) <= largest]
    later = f"; from {emulated[0][1].split('..')[0]} bytes on it would be" if emulated else ""
    report.info(
        name,
        "UCX protocol emulated",
        f"YES for these copies (UCX stages them itself, not the copy engine): {used[0]}"
        if used
        else f"not for these copies (at most {largest} bytes){later}",
    )


def _make(path: str, lay, pool):
    if path == "copy engine":
        from vllm_kvbm.worker.copy_engine import CopyEngineMover

        return CopyEngineMover(
            lay.caches, lay.num_blocks, pool, lay.block_dims, page_blocks=PAGE_BLOCKS
        )
    from vllm_kvbm.worker.page_mover import PageMover

    return PageMover(
        lay.caches, lay.num_blocks, pool, name=agent_name("kvbm-paths"), block_dims=lay.block_dims
    )


def run_paths(
    args, device: torch.device, report, tp: int, deadline: float, path: str = "copy engine"
) -> None:
    """``path``: "copy engine" (the paths-70b cases) or "NIXL" (nixl-70b)."""
    name = f"{'paths' if path == 'copy engine' else 'nixl'}-70b-tp{tp}"
    cuda = device.type == "cuda"
    if path == "copy engine" and not cuda:
        report.info(
            name,
            "copy engine",
            "skipped: no CUDA device (the CPU run times NIXL in the nixl-70b cases)",
        )
        return
    pages = args.paths_pages * tp  # the same bytes at every TP: blocks are 1/tp the size
    for layout in LAYOUTS:
        what = f"{layout} {path}"
        if time.perf_counter() > deadline:
            report.info(name, what, "skipped: the time budget is spent")
            continue
        try:
            run_one(args, report, name, what, layout, tp, pages, path, device, deadline)
        except Exception as err:  # one layout's failure ends only its rows
            report.check(name, f"{what} ran", False, f"{type(err).__name__}: {err}")
        if cuda:
            torch.cuda.empty_cache()


def run_one(
    args,
    report,
    name: str,
    what: str,
    layout: str,
    tp: int,
    pages: int,
    path: str,
    device: torch.device,
    deadline: float,
) -> None:
    cuda = device.type == "cuda"
    nb = pages * PAGE_BLOCKS
    lay = vllm_layout(
        layout,
        args.layers_70b,
        2 * nb,
        heads=8 // tp,
        block_size=16,
        head_size=128,
        gen=None,
        dtype=torch.bfloat16,
        device=device,
        pad=0,
    )
    lay.raw[0].view(torch.uint8).random_(0, 256)
    bb = lay.block_bytes()
    nbytes = nb * bb
    host = HostPool(nb, bb, pin=cuda, device=device)
    report.info(
        name,
        f"{what} geometry",
        f"{args.layers_70b} layers, {8 // tp} KV heads of "
        f"128: {bb / 2**20:.2f} MiB blocks, {pages} pages = {nbytes / 2**20:.0f} MiB "
        f"per transfer (pinned: {host.pinned})",
    )
    nixl = path == "NIXL"
    ucx_log = tempfile.NamedTemporaryFile(prefix="kvbm-ucx-", suffix=".log", delete=False)
    ucx_log.close()
    saved = os.environ.get("UCX_PROTO_INFO")
    if nixl and saved is None:
        os.environ["UCX_PROTO_INFO"] = "y"  # read when the agent's UCX context starts
    src, dst = list(range(nb)), list(range(nb, 2 * nb))
    running = False  # a transfer still in flight: nothing of its memory may be released
    try:
        # UCX writes its protocol tables from C: what the process writes goes to the log too
        with teed_output(ucx_log.name) if nixl else contextlib.nullcontext():
            mover = _make(path, lay, host.tensor)
            try:
                running = not _measure(
                    args, report, name, what, mover, lay, src, dst, nbytes, device, deadline
                )
            finally:
                if running:  # closing under a running transfer crashes UCX: left to exit
                    report.info(name, f"{what} left open", "a transfer was still running")
                else:
                    mover.close()
        if nixl:
            with open(ucx_log.name, errors="replace") as f:
                ucx_protocol_rows(
                    report, name, f.read(), max(r.layer_block_bytes for r in mover.regions)
                )
    finally:
        if nixl and saved is None:
            os.environ.pop("UCX_PROTO_INFO", None)
        os.unlink(ucx_log.name)
        if running:  # its memory stays allocated and registered until the process exits
            _KEPT.append((lay, host))
        else:
            host.release()
        del lay


def _measure(
    args,
    report,
    name: str,
    what: str,
    mover,
    lay,
    src,
    dst,
    nbytes: int,
    device: torch.device,
    deadline: float,
) -> bool:
    """Stores and loads, best of ``repeats``; False if one is still running."""
    best = [float("inf"), float("inf")]
    for _ in range(args.repeats):
        for i, (to_host, blocks) in enumerate(((True, src), (False, dst))):
            sync(device)
            left = max(1.0, min(args.timeout, deadline - time.perf_counter()))
            state, secs = mover_seconds(mover, to_host, blocks, src, left)
            if state != "DONE":
                report.check(
                    name,
                    f"{what} pages stored and loaded back, bytes equal",
                    False,
                    f"a transfer ended {state}",
                )
                return state != "PROC"
            best[i] = min(best[i], secs)
    copies = getattr(mover, "page_copies", None) or nixl_page_copies(mover.regions, PAGE_BLOCKS)
    report.info(name, f"{what} copies", str(copies))
    kv = lay.raw[0].cpu()
    equal = all(
        torch.equal(lay.slot_bytes(d, [kv]), lay.slot_bytes(s, [kv]))
        for s, d in ((src[0], dst[0]), (src[-1], dst[-1]))
    )
    report.check(
        name,
        f"{what} pages stored and loaded back, bytes equal",
        equal,
        "first and last block compared",
    )
    ref = copy_seconds(nbytes, device, args.repeats)
    ratios = [r / b for r, b in zip(ref, best)]
    for i, direction in enumerate(("offload d2h", "onboard h2d")):
        report.info(
            name,
            f"{what} {direction} GB/s (vs copy_)",
            f"{nbytes / best[i] / 1e9:.1f} / {nbytes / ref[i] / 1e9:.1f} "
            f"({ratios[i]:.2f}x; {timing_of(mover)}, copy_ by "
            f"{EVENTS if device.type == 'cuda' else 'perf_counter'})",
        )
    if what.endswith("copy engine"):
        met = min(ratios) >= TARGET_RATIO
        report.info(
            name,
            f"{what} at {TARGET_RATIO}x of copy_",
            "met" if met else f"NOT met ({min(ratios):.2f}x)",
        )
    return True
