"""GPU check of KVBM's worker side: stream order, exact bytes, the copy paths' speed, a vLLM run.

Runs on a CUDA machine with PyTorch, NIXL and this repository (scripts/gpu_check.sh
runs it, also without network); ``--device cpu`` runs the same logic on CPU tensors.
A probe (a pinned ``copy_``) first sizes the cases to finish within ``--budget-s``
(four minutes); every row is printed and flushed as it is made; cases not started
when the budget is spent are skipped with a row saying so.

Cases, in the order they run (what KVBM runs in production first, NIXL last):

- "packed-blhnc", then (after the paths and vllm cases) "flash-attn", "flashinfer-hnd",
  "mla", "kernel-split" and "mla-v2-lite": a KV layout of vLLM 0.32's CUDA attention
  backends (laid out exactly as vLLM's create_kv_cache_views does,
  tests/helpers/kv_layouts.py: BLHNC, what KVBM asks vLLM for; FlashAttention LBNHC;
  FlashInfer LBHNC (HND); MLA; blocks split into smaller kernel blocks; DeepSeek-V2-Lite's
  MLA geometry), with the real KVBMWorker and its copy path, driven as vLLM drives it
  (transfers polled once per engine step, ``--step-s``):

  1. stores: a kernel rewrites every KV byte and, at once, as vLLM's wait_for_save does
     right after launching the forward pass, the stores start; the host pages must equal
     the KV *after* the kernel. The control (CUDA): the same copies with no wait at all,
     which must read stale KV: it shows the race is there for the fence to prevent, i.e.
     that the check above can fail.
  2. loads: a kernel zeroes the destination blocks and the loads start at once; they must
     hold the stored pages, every other KV byte unchanged.
  3. bandwidth: offload and onboard through the worker's mover against a pinned ``copy_``
     (gpu_check_paths.py: CUDA events on both where the copy engines run).

- "paths-70b-tp1", "-tp8" (gpu_check_paths.py): the copy engines at a 70B model's page
  geometry, BLHNC then LBNHC, the same bytes at both TPs, against ``copy_``.
- "vllm" (gpu_check_vllm.py): an offline vLLM engine with KVBM at block size 16: vLLM takes
  BLHNC, a prompt onboarded from the host tier equals its recompute.
- "pages": pages of 16 blocks stored whole and loaded with the first block skipped (a page
  that begins inside vLLM's own hit); "70b-pages" the same at a 70B model's page (80
  layers, 8 KV heads of 128, bf16, 16-token blocks, 256-token pages: 80 MiB; GEOMETRY_70B).
- "hybrid" (gpu_check_hybrid.py): the KV cache of vLLM's hybrid allocator, where a layer of
  each KV cache group views one shared tensor (Qwen3-Next, Gemma 3).
- "nixl-70b-tp1", "-tp8" (gpu_check_paths.py): NIXL at the same geometry, with UCX's
  protocol; "gds" (gpu_check_gds.py): a file read into GPU memory by NIXL's GDS plugins.
- "peer-read" (gpu_check_peer.py), in a child process of its own: a real kvbm-pool process
  serves pages; this machine's peer reader reads them into pinned host memory, every byte
  checked, against a raw NIXL READ on the same transport, then copies them to the GPU.

The exit status is 0 only if every check passed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import torch  # noqa: E402

from helpers.kv_layouts import vllm_layout  # noqa: E402
from vllm_kvbm.messages import SKIP  # noqa: E402

from gpu_check_harness import (  # noqa: E402
    GEOMETRY_70B,
    Geometry,
    Report,
    Worker,
    delay,
    rewrite_kv,
)
from gpu_check_gds import run_gds, sync  # noqa: E402
from gpu_check_hybrid import run_hybrid  # noqa: E402
from gpu_check_layouts import run_case  # noqa: E402
from gpu_check_paths import copy_seconds, report_bandwidth, run_paths  # noqa: E402
from gpu_check_peer import CASE_S as PEER_CASE_S, peer_pages, run_peer  # noqa: E402
from gpu_check_vllm import CASE_S, run_vllm  # noqa: E402

EXTRA_CASES = [
    "pages",
    "70b-pages",
    "paths-70b-tp1",
    "paths-70b-tp8",
    "vllm",
    "hybrid",
    "nixl-70b-tp1",
    "nixl-70b-tp8",
    "gds",
    "peer-read",
]
# BLHNC and the copy engines first, then a vLLM engine, the other layouts, NIXL last
# (the peer read between two processes, in a child, the very last).
ORDER = [
    "packed-blhnc",
    "paths-70b-tp1",
    "paths-70b-tp8",
    "vllm",
    "flash-attn",
    "flashinfer-hnd",
    "mla",
    "kernel-split",
    "mla-v2-lite",
    "pages",
    "70b-pages",
    "hybrid",
    "nixl-70b-tp1",
    "nixl-70b-tp8",
    "gds",
    "peer-read",
]
BUDGET_S = 240.0  # the whole run, sized by the probe
TRANSFER_S = 0.02  # copy_ time of one transfer the probe sizes the cases to


def run_pages(
    args,
    device: torch.device,
    report: Report,
    name: str = "pages",
    geo: Geometry | None = None,
    pages: int | None = None,
) -> None:
    """Pages of ``geo.page_blocks`` blocks: stored whole, loaded skipping a block,
    then offload/onboard bandwidth of whole pages against ``copy_``."""
    geo = geo or Geometry(
        args.layers, args.heads, args.head_size, args.block_size, args.page_blocks
    )
    g = geo.page_blocks
    n = pages or max(1, args.blocks // (2 * g))  # pages; each loaded back into other blocks
    lay = vllm_layout(
        "LBNHC",
        geo.layers,
        max(args.blocks if pages is None else 0, 2 * n * g),
        heads=geo.kv_heads,
        block_size=geo.block_size,
        head_size=geo.head_size,
        gen=None,
        dtype=torch.bfloat16,
        device=device,
        pad=4096,
    )
    lay.raw[0].view(torch.uint8).random_(0, 256)
    sync(device)
    src, dst = list(range(n * g)), list(range(n * g, 2 * n * g))
    slots = list(range(n))[::-1]
    report.info(
        name,
        "pages",
        f"{n} pages of {g} blocks x {geo.block_size} tokens, "
        f"{geo.layers} layers, {geo.kv_heads} KV heads of {geo.head_size}: "
        f"{geo.page_bytes / 1024**2:.1f} MiB each, {n * geo.page_bytes / 1024**3:.2f} "
        f"GiB per transfer",
    )
    report.check(
        name,
        "block size as computed",
        lay.block_bytes() == geo.block_bytes,
        f"{lay.block_bytes()} bytes laid out, {geo.block_bytes} computed",
    )
    wk = Worker(lay, n, geo.block_size, args.timeout, page_blocks=g, step_s=args.step_s)
    try:
        pool = wk.w.host_pool
        delay(device, args.kernel_delay)
        rewrite_kv(lay, 1)
        job = wk.store(src, slots)
        wk.until(lambda: wk.done[job] or wk.failed[job])
        sync(device)
        kv_cpu = [lay.raw[0].cpu()]
        bad = sum(
            not torch.equal(
                pool[s], torch.cat([lay.slot_bytes(b, kv_cpu) for b in src[i * g : (i + 1) * g]])
            )
            for i, s in enumerate(slots)
        )
        del kv_cpu
        report.check(
            name,
            "pages stored whole, one slot each",
            not bad and wk.done[job],
            f"{n - bad}/{n} host pages byte-equal",
        )

        kv_before = lay.raw[0].to("cpu", copy=True)
        delay(device, args.kernel_delay)
        for b in dst:
            lay.zero_block(b)
        req = wk.load([SKIP] + dst[1:], slots)  # the first block is vLLM's own
        wk.until(lambda: req in wk.recving)
        sync(device)
        kv_cpu = [lay.raw[0].cpu()]
        expected = [kv_before.clone()]
        for b in dst[:1]:
            for page in lay.pages(expected, b):
                page.zero_()
        for b, a in zip(dst[1:], src[1:]):
            want = lay.slot_bytes(a, [kv_before])
            off = 0
            for page in lay.pages(expected, b):
                page.copy_(want[off : off + page.numel()])
                off += page.numel()
        report.check(
            name,
            "pages loaded, the skipped block untouched",
            torch.equal(kv_cpu[0], expected[0]) and not wk.failed,
            f"{len(dst) - 1} blocks loaded, 1 skipped; failed: {dict(wk.failed)}",
        )
        del kv_cpu, expected, kv_before

        rows = [s * g + i for s in slots for i in range(g)]  # the mover's rows: a block each
        report_bandwidth(
            report,
            name,
            wk.w.mover,
            src,
            dst,
            rows,
            n * geo.page_bytes,
            device,
            args.repeats,
            args.timeout,
        )
        report.check(name, "no transfer failed", not wk.failed, f"failed: {dict(wk.failed)}")
    finally:
        wk.w.shutdown()
        del lay


def probe(args, device: torch.device, report: Report) -> None:
    """A pinned copy_ of 64 MiB (4 on CPU) first: the sizes left unset are
    chosen from its speed so that every case moves about ``TRANSFER_S`` of
    copying per transfer and the whole run fits ``--budget-s``."""
    cuda = device.type == "cuda"
    n = (64 if cuda else 4) << 20
    off, on = copy_seconds(n, device, 2)
    gbps = n / max(off, on) / 1e9
    # The slower path (NIXL over TCP: ~1.8 GB/s) may be ~25x slower than copy_.
    target = int(min(max(gbps * 1e9 * TRANSFER_S, 16 << 20), 1 << 30))
    block = 2 * 8 * 16 * 128 * 2  # one layer block of the default cases
    args.layers = args.layers or (32 if cuda else 4)
    args.blocks = args.blocks or max(16, 2 * target // (block * args.layers))
    args.slots = args.slots or args.blocks // 2
    page_70b = GEOMETRY_70B.page_bytes * args.layers_70b // GEOMETRY_70B.layers
    pages = max(1, min(8, target // page_70b)) if cuda else 1  # CPU: the logic only
    args.pages_70b = args.pages_70b or pages
    args.paths_pages = args.paths_pages or pages
    args.gds_mib = args.gds_mib or max(16, min(512, target >> 20))
    args.peer_pages = args.peer_pages or peer_pages(target, args.peer_page_kib)
    report.info(
        "probe",
        "pinned copy_ GB/s",
        f"{n / off / 1e9:.1f} d2h, {n / on / 1e9:.1f} h2d; "
        f"about {target >> 20} MiB per transfer: {args.blocks} blocks of "
        f"{args.layers} layers, {args.pages_70b} 70B pages, {args.paths_pages} at TP=1 "
        f"in the paths and nixl cases (x8 at TP=8: the same bytes), {args.gds_mib} MiB "
        f"read by gds, {args.peer_pages} pages of {args.peer_page_kib} KiB by peer-read; "
        f"budget {args.budget_s:.0f} s",
    )


def run(name: str, args, device: torch.device, report: Report, deadline: float) -> None:
    if name == "pages":
        run_pages(args, device, report)
    elif name == "70b-pages":
        geo = Geometry(
            args.layers_70b,
            GEOMETRY_70B.kv_heads,
            GEOMETRY_70B.head_size,
            GEOMETRY_70B.block_size,
            GEOMETRY_70B.page_blocks,
        )
        run_pages(args, device, report, name, geo, args.pages_70b)
    elif name.startswith(("paths-70b-tp", "nixl-70b-tp")):
        run_paths(
            args,
            device,
            report,
            int(name.rsplit("tp", 1)[1]),
            deadline,
            "NIXL" if name.startswith("nixl") else "copy engine",
        )
    elif name == "vllm":
        run_vllm(args, device, report, deadline)
    elif name == "gds":
        run_gds(args, device, report)
    elif name == "peer-read":
        run_peer(args, device, report, deadline)
    elif name == "hybrid":
        run_hybrid(args, device, report, Worker)
    else:
        run_case(name, args, device, report)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument(
        "--cases",
        nargs="+",
        default=ORDER,
        choices=ORDER,
        help="which cases, in this order (default: all, in the order listed)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=BUDGET_S,
        help="the run's time budget: the probe sizes the cases to it, and cases "
        "not started when it is spent are skipped (rows say so)",
    )
    p.add_argument(
        "--step-s",
        type=float,
        default=0.005,
        help="seconds between polls of a transfer: an engine step",
    )
    p.add_argument(
        "--page-blocks",
        type=int,
        default=16,
        help="blocks per page of the pages case (16: the default at block size 16)",
    )
    p.add_argument(
        "--pages-70b",
        type=int,
        default=None,
        help="pages of the 70b-pages case (default: sized by the probe, at most 8)",
    )
    p.add_argument(
        "--paths-pages",
        type=int,
        default=None,
        help="pages per transfer of the paths-70b cases (default: by the probe)",
    )
    p.add_argument(
        "--layers-70b",
        type=int,
        default=GEOMETRY_70B.layers,
        help="layers of the 70B cases (fewer only to try them on a small machine)",
    )
    p.add_argument(
        "--gds-mib",
        type=int,
        default=None,
        help="file size of the gds case (default: sized by the probe)",
    )
    p.add_argument(
        "--gds-dir",
        default=None,
        help="directory of the gds case's file (default: the system's temp dir)",
    )
    p.add_argument(
        "--peer-pages",
        type=int,
        default=None,
        help="pages kvbm-pool serves to the peer-read case (default: by the probe)",
    )
    p.add_argument("--peer-page-kib", type=int, default=4096, help="their size")
    p.add_argument(
        "--peer-ucx-tls",
        default=None,
        help="UCX_TLS of the peer-read case's two processes (tcp: as between "
        "machines; default: UCX's choice, or UCX_TLS as set)",
    )
    p.add_argument(
        "--peer-timeout-s",
        type=float,
        default=PEER_CASE_S,
        help="the peer-read case's child is killed after this long at most",
    )
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--blocks", type=int, default=None, help="engine KV blocks")
    p.add_argument("--slots", type=int, default=None, help="host tier slots")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument(
        "--mla-head-size", type=int, default=576, help="MLA latent + rope dims (DeepSeek: 512 + 64)"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--kernel-delay",
        type=float,
        default=0.05,
        help="seconds the stream stays busy before the KV-writing kernel",
    )
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument(
        "--vllm-model",
        default=None,
        help="model of the vllm case (default: a small random-weight Llama built "
        "here, offline, in models/)",
    )
    p.add_argument(
        "--vllm-cpu",
        action="store_true",
        help="run the vllm case on vLLM's CPU build too (minutes; skipped on CPU)",
    )
    p.add_argument(
        "--vllm-timeout-s",
        type=float,
        default=CASE_S,
        help="the vllm case's engine run ends after this long at most",
    )
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        p.error("no CUDA device; use --device cpu")
    if cuda and device.index is None:
        # with its index: HostPool's registering threads set it as their device, and
        # torch.cuda.set_device refuses a CUDA device without one (nothing was pinned)
        device = torch.device("cuda", torch.cuda.current_device())
    start = time.perf_counter()
    deadline = start + args.budget_s
    print(
        f"gpu_check: torch {torch.__version__} (CUDA {torch.version.cuda}), device "
        f"{torch.cuda.get_device_name(device) if cuda else 'cpu'}, "
        f"UCX_TLS={os.environ.get('UCX_TLS', '(default)')}",
        flush=True,
    )
    report = Report()
    probe(args, device, report)
    for name in args.cases:
        if time.perf_counter() > deadline:
            report.info(name, "skipped", f"the {args.budget_s:.0f} s budget is spent")
            continue
        try:
            run(name, args, device, report, deadline)
        except Exception as err:  # a crash is a failed check, not a lost run
            report.check(name, "ran", False, f"{type(err).__name__}: {err}")
        if cuda:
            torch.cuda.empty_cache()
    total = report.passed + report.failed
    elapsed = time.perf_counter() - start
    if report.failed:
        print(f"gpu_check: {report.failed} of {total} checks FAILED ({elapsed:.0f} s)", flush=True)
        return 1
    print(f"gpu_check: all {total} checks passed ({elapsed:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
