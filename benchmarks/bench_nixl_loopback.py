"""NIXL's UCX loopback on host memory: which transport, which direction, how many
descriptors, which thread; against a memcpy of the same bytes.

What PageMover does on CPU (vllm_kvbm/worker/page_mover.py) was chosen from
these three tables; all in one process, every path timed once per round,
rounds interleaved (other work on the machine hits every path alike).

1. Transports: agents created with UCX settings passed as NIXL backend
   parameters (``engine_config``, applied when UCX_TLS etc. are unset in the
   environment), loads (host pool -> KV cache) as READs or as WRITEs from the
   host pool, stores as WRITEs. A configuration UCX refuses is listed with
   its error.
2. Descriptors: the same bytes as 64, 512 or 4096 descriptors.
3. Threads: the self transport's copy inline in the post (the default), or
   on PageMover's copy thread (``copy_thread=True``) while the posting thread sleeps, runs Python (holding the
   GIL), or burns CPU without the GIL.

    .venv/bin/python benchmarks/bench_nixl_loopback.py [--rounds 7] [--parts threads ...]

Run it with UCX_TLS unset (a UCX_TLS in the environment overrides every row).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import time

import numpy as np
import torch

from vllm_kvbm.worker.page_mover import HOST_LOOPBACK_PARAMS, PageMover, _nixl_api

BLOCKS = 64  # one 8k-token hit of the local model
BYTES = BLOCKS * (2 << 20)  # 2 MiB of KV per block


def median(ts: list[float]) -> float:
    return sorted(ts)[len(ts) // 2]


class RawLoopback:
    """One agent, both memories registered, dlists prepared both ways round."""

    def __init__(self, name: str, params: dict, caches, pool, num_blocks: int, load_as_write: bool):
        nixl_agent, nixl_agent_config, _ = _nixl_api()
        self.agent = nixl_agent(name, nixl_agent_config(backends=[], enable_prog_thread=False))
        self.agent.create_backend("UCX", params)
        self.load_as_write = load_as_write
        layers = len(caches)
        page = pool.shape[1] // layers
        kv = next(iter(caches.values()))
        self.regs = [
            self.agent.register_memory(
                [(kv.untyped_storage().data_ptr(), kv.untyped_storage().nbytes(), 0, "")],
                mem_type="DRAM",
            ),
            self.agent.register_memory(pool),
        ]
        kv_addr = np.array(
            [[t.data_ptr() + b * page for b in range(num_blocks)] for t in caches.values()],
            dtype=np.uint64,
        ).ravel()
        host_addr = (
            pool.data_ptr()
            + np.arange(num_blocks, dtype=np.uint64)[:, None] * np.uint64(layers * page)
            + np.arange(layers, dtype=np.uint64)[None, :] * np.uint64(page)
        ).ravel()

        def rows(addr):
            return np.stack([addr, np.full_like(addr, page), np.zeros_like(addr)], 1)

        a = self.agent
        self.kv_local = a.prep_xfer_dlist("NIXL_INIT_AGENT", rows(kv_addr), "DRAM")
        self.host_remote = a.prep_xfer_dlist(a.name, rows(host_addr), "DRAM")
        self.host_local = a.prep_xfer_dlist("NIXL_INIT_AGENT", rows(host_addr), "DRAM")
        self.kv_remote = a.prep_xfer_dlist(a.name, rows(kv_addr), "DRAM")
        blocks = np.arange(BLOCKS)
        slots = np.arange(num_blocks - 1, num_blocks - 1 - BLOCKS, -1)
        ids = np.arange(layers)
        self.kv_idx = (ids[None, :] * num_blocks + blocks[:, None]).ravel().astype(np.int32)
        self.host_idx = (slots[:, None] * layers + ids[None, :]).ravel().astype(np.int32)

    def copy(self, to_host: bool) -> None:
        a = self.agent
        if to_host:
            h = a.make_prepped_xfer(
                "WRITE", self.kv_local, self.kv_idx, self.host_remote, self.host_idx
            )
        elif self.load_as_write:
            h = a.make_prepped_xfer(
                "WRITE", self.host_local, self.host_idx, self.kv_remote, self.kv_idx
            )
        else:
            h = a.make_prepped_xfer(
                "READ", self.kv_local, self.kv_idx, self.host_remote, self.host_idx
            )
        state = a.transfer(h)
        while state == "PROC":
            state = a.check_xfer_state(h)
        h.release()
        assert state == "DONE", state

    def close(self) -> None:
        for d in (self.kv_local, self.host_remote, self.host_local, self.kv_remote):
            d.release()
        for r in self.regs:
            self.agent.deregister_memory(r)


def layout(layers: int, num_blocks: int):
    page = BYTES // BLOCKS // layers
    kv = torch.zeros(layers, num_blocks, page, dtype=torch.uint8)
    pool = torch.ones(num_blocks, layers * page, dtype=torch.uint8)
    return {f"layer{i}": kv[i] for i in range(layers)}, pool


def run_rounds(paths: dict, rounds: int) -> dict[str, list[float]]:
    for fn in paths.values():
        fn()  # warm up: page faults, first-use setup
    times: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(rounds):
        for k, fn in paths.items():
            start = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - start)
    return times


def memcpy_path():
    src = torch.ones(BYTES, dtype=torch.uint8)
    dst = torch.zeros(BYTES, dtype=torch.uint8)
    return lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), BYTES)


def transports(rounds: int) -> None:
    caches, pool = layout(8, 2 * BLOCKS)
    configs = [
        ("UCX's choice (cma), num_threads=1, loads READ [before]", {"num_threads": "1"}, False),
        ("UCX's choice (cma), num_threads=2, loads READ", {"num_threads": "2"}, False),
        ("TLS=self, default error handling (peer)", {"engine_config": "TLS=self"}, True),
        (
            "TLS=self, no error handling, loads READ",
            {"engine_config": "TLS=self", "ucx_error_handling_mode": "none"},
            False,
        ),
        (
            "TLS=self, no error handling, loads WRITE [now, inline]",
            dict(HOST_LOOPBACK_PARAMS),
            True,
        ),
        ("TLS=tcp", {"engine_config": "TLS=tcp"}, False),
        # engine_config splits on commas: one transport per TLS there
        ("TLS=posix", {"engine_config": "TLS=posix"}, False),
        ("TLS=sysv", {"engine_config": "TLS=sysv"}, False),
    ]
    paths = {"memcpy (one thread, same bytes)": memcpy_path()}
    movers, refused = [], {}
    for i, (label, params, as_write) in enumerate(configs):
        try:
            m = RawLoopback(f"bench-t{i}", params, caches, pool, 2 * BLOCKS, as_write)
        except Exception as err:  # UCX refuses the configuration
            refused[label] = f"{type(err).__name__}: {err}"
            continue
        movers.append(m)
        paths[f"{label} | load"] = lambda m=m: m.copy(False)
        paths[f"{label} | store"] = lambda m=m: m.copy(True)
    print_gbps(
        f"Transports: {BYTES >> 20} MiB per transfer, {BLOCKS} blocks x 8 layers x 256 KiB",
        ("configuration", "direction"),
        run_rounds(paths, rounds),
        rounds,
    )
    for label, err in refused.items():
        print(f"| {label} | refused: {err} | | | |")
    for m in movers:
        m.close()


def print_gbps(title: str, columns: tuple[str, str], times: dict, rounds: int) -> None:
    """A table of each path's GB/s (keys "label | second column") against the memcpy."""
    base = median(times["memcpy (one thread, same bytes)"])
    print(f"\n### {title}, {rounds} interleaved rounds (load average {os.getloadavg()[0]:.1f})\n")
    print(f"| {columns[0]} | {columns[1]} | GB/s best | GB/s median | median / memcpy |")
    print("|---|---|---:|---:|---:|")
    for k, ts in times.items():
        label, _, second = k.partition(" | ")
        print(
            f"| {label} | {second or '-'} | {BYTES / min(ts) / 1e9:.2f} "
            f"| {BYTES / median(ts) / 1e9:.2f} | {base / median(ts):.2f} |"
        )


def descriptors(rounds: int) -> None:
    paths = {"memcpy (one thread, same bytes)": memcpy_path()}
    movers, memory = [], []
    for layers in (1, 8, 64):
        caches, pool = layout(layers, 2 * BLOCKS)
        memory.append((caches, pool))  # a mover does not keep its memory alive
        page_kib = BYTES // BLOCKS // layers >> 10
        for loopback in ("self", "default"):
            m = PageMover(
                caches, 2 * BLOCKS, pool, name=f"bench-d{layers}{loopback}", loopback=loopback
            )
            movers.append(m)
            blocks = list(range(BLOCKS))
            slots = list(range(2 * BLOCKS - 1, BLOCKS - 1, -1))

            def load(m=m, blocks=blocks, slots=slots):
                h = m.post(False, blocks, slots)
                while m.poll(h) == "PROC":
                    time.sleep(0.0002)

            paths[f"{loopback} | {layers * BLOCKS} x {page_kib} KiB"] = load
    print_gbps(
        f"Descriptors per transfer: loads of {BYTES >> 20} MiB",
        ("PageMover loopback", "descriptors"),
        run_rounds(paths, rounds),
        rounds,
    )
    for m in movers:
        m.close()


def threads(rounds: int) -> None:
    caches, pool = layout(8, 2 * BLOCKS)
    m = PageMover(caches, 2 * BLOCKS, pool, name="bench-threads", copy_thread=True)
    blocks = list(range(BLOCKS))
    slots = list(range(2 * BLOCKS - 1, BLOCKS - 1, -1))
    kv_idx, host_idx = m._indices(blocks, slots)
    buf = bytes(1 << 20)

    def inline():
        h = m.agent.make_prepped_xfer("WRITE", m._host_src, host_idx, m._kv_dst, kv_idx)
        assert m.agent.transfer(h) == "DONE"
        h.release()

    def python_for(seconds: float):
        end = time.perf_counter() + seconds
        n = 0
        while time.perf_counter() < end:
            n += 1

    def no_gil_for(seconds: float):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            hashlib.sha256(buf)  # the GIL released while it hashes

    def threaded(between_polls):
        h = m.post(False, blocks, slots)
        while m.poll(h) == "PROC":
            between_polls()

    paths = {
        "memcpy (one thread, same bytes)": memcpy_path(),
        "inline: the copy in the posting thread's NIXL call": inline,
        "copy thread; poster sleeps 0.2 ms between polls": lambda: threaded(
            lambda: time.sleep(0.0002)
        ),
        "copy thread; poster runs Python (GIL held), polls every 0.1 ms": lambda: threaded(
            lambda: python_for(0.0001)
        ),
        "copy thread; poster runs Python (GIL held), polls every 2 ms": lambda: threaded(
            lambda: python_for(0.002)
        ),
        "copy thread; poster burns CPU without the GIL, polls every 2 ms": lambda: threaded(
            lambda: no_gil_for(0.002)
        ),
    }
    times = run_rounds(paths, rounds)
    base = median(times["memcpy (one thread, same bytes)"])
    print(
        f"\n### Threads: loads of {BYTES >> 20} MiB through the self transport, {rounds} "
        f"interleaved rounds (load average {os.getloadavg()[0]:.1f})\n"
    )
    print("| path | ms best | ms median | median / memcpy |")
    print("|---|---:|---:|---:|")
    for k, ts in times.items():
        print(f"| {k} | {min(ts) * 1e3:.1f} | {median(ts) * 1e3:.1f} | {median(ts) / base:.2f} |")
    m.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--parts",
        nargs="+",
        default=["transports", "descriptors", "threads"],
        choices=["transports", "descriptors", "threads"],
    )
    args = parser.parse_args()
    if "UCX_TLS" in os.environ:
        print(f"note: UCX_TLS={os.environ['UCX_TLS']} overrides every configuration below")
    print(f"{os.cpu_count()} cores")
    for part in args.parts:
        globals()[part](args.rounds)


if __name__ == "__main__":
    main()
