"""Time of the scheduler's lookups on an LMCache server (``lm://``), with and
without TCP_QUICKACK on the lookup socket.

A real LMCache server on 127.0.0.1 and the scheduler's RemoteView: each
question sends its EXIST requests pipelined and reads the replies back. The
server writes each reply on its own with Nagle's algorithm on, so without an
immediate ACK from the client the second reply waits for a delayed ACK
(about 40 ms on Linux). Printed: the median and max time of a question of
1, 2, 4 and 16 keys, each way, and the ratio.

    .venv/bin/python benchmarks/bench_remote_lookup.py [--rounds 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def timed(view, keys: list[bytes], rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        start = time.monotonic()
        view.contains_many(keys)
        out.append(time.monotonic() - start)
    return out


def main(argv: list[str] | None = None) -> int:
    from vllm_kvbm.tiers.lm import view as lm_view
    from vllm_kvbm.tools.server import free_port, start_lmcache_server, stop_process

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    port = free_port()
    server = start_lmcache_server(port)
    quick_ack = lm_view.quick_ack
    try:
        view = lm_view.RemoteView(f"lm://127.0.0.1:{port}", "bench", 2 << 20, 1)
        view.contains_many([b"warm" * 8])  # connects (the server is up: start_lmcache_server)
        print(
            "| keys per question | with quick ACK: median / max | without: median / max "
            "| median without / with |"
        )
        print("|---:|---:|---:|---:|")
        for n in (1, 2, 4, 16):
            keys = [bytes([i % 256]) * 32 for i in range(n)]
            lm_view.quick_ack = quick_ack
            fast = timed(view, keys, args.rounds)
            lm_view.quick_ack = lambda sock: None
            slow = timed(view, keys, args.rounds)
            lm_view.quick_ack = quick_ack
            f, s = statistics.median(fast), statistics.median(slow)
            print(
                f"| {n} | {f * 1e3:.2f} / {max(fast) * 1e3:.2f} ms | {s * 1e3:.2f} / "
                f"{max(slow) * 1e3:.2f} ms | {s / f:.1f}x |"
            )
        view.close()
    finally:
        lm_view.quick_ack = quick_ack
        stop_process(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
