"""The real LMBenchmark client (``synthetic-multi-round-qa/multi-round-qa.py``
of an LMBenchmark checkout) run against a server with kvbm-bench's sizes."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

from vllm_kvbm.bench.client import read_csv, summarize, workload_size

LMB_CLIENT = Path("synthetic-multi-round-qa") / "multi-round-qa.py"


def lmbenchmark_time(args) -> int:
    """Seconds LMBenchmark's client runs: long enough to send as many requests
    at --qps as kvbm-bench's own run sends."""
    return args.lmbenchmark_time or max(30, math.ceil(workload_size(args) / args.qps))


def lmbenchmark_cmd(args, url: str, csv_path: Path) -> list[str]:
    """LMBenchmark's client with kvbm-bench's sizes (its own flags, as its
    long_input_short_output_run.sh passes them)."""
    return [
        args.lmbenchmark_python,
        str(Path(args.lmbenchmark_dir) / LMB_CLIENT),
        "--num-users",
        str(args.num_users),
        "--num-rounds",
        str(args.num_rounds),
        "--qps",
        str(args.qps),
        "--shared-system-prompt",
        str(args.shared_system_prompt),
        "--user-history-prompt",
        str(args.user_history_prompt),
        "--answer-len",
        str(args.answer_len),
        "--model",
        args.model,
        "--base-url",
        url,
        "--init-user-id",
        "1",
        "--output",
        str(csv_path.resolve()),
        "--log-interval",
        "30",
        "--time",
        str(lmbenchmark_time(args)),
    ]


def lmbenchmark_problem(args) -> str:
    """Why LMBenchmark's client cannot run here, or ''."""
    client = Path(args.lmbenchmark_dir) / LMB_CLIENT
    if not client.is_file():
        return f"{args.lmbenchmark_dir} is not an LMBenchmark checkout: {client} not found"
    check = subprocess.run(
        [args.lmbenchmark_python, client.name, "--help"],
        cwd=client.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if check.returncode != 0:
        last = (check.stderr or check.stdout).strip().splitlines()[-1:] or ["no output"]
        return (
            f"LMBenchmark's client does not start with {args.lmbenchmark_python} "
            f"(it imports openai and pandas): {last[0]}"
        )
    return ""


def run_lmbenchmark(args, url: str, name: str, out_dir: Path) -> tuple[dict, str]:
    """(summary, error) of one run of the real LMBenchmark client."""
    csv_path = out_dir / f"lmbenchmark-{name}.csv"
    log_path = out_dir / f"lmbenchmark-{name}.log"
    limit = lmbenchmark_time(args) + args.request_timeout + 120
    try:
        with open(log_path, "w") as log:
            proc = subprocess.run(
                lmbenchmark_cmd(args, url, csv_path),
                cwd=Path(args.lmbenchmark_dir) / LMB_CLIENT.parent,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=limit,
            )
    except subprocess.TimeoutExpired:
        return {}, f"LMBenchmark's client still running after {limit:.0f} s; log {log_path}"
    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-5:])
    if proc.returncode != 0:
        return {}, f"LMBenchmark's client exited {proc.returncode}:\n{tail}"
    rows = read_csv(csv_path) if csv_path.exists() else []
    if not rows:
        return {}, f"LMBenchmark's client finished no request (log {log_path}):\n{tail}"
    return summarize(rows), ""
