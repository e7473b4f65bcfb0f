"""The "vllm" case of benchmarks/gpu_check.py: an offline vLLM engine with KVBM, at block size 16.

What the other cases check piece by piece, here through vLLM itself: an
``LLM`` with KVBM as its KV connector (``kv_connector_module_path``, so an
uninstalled checkout works too), 16-token blocks, eager mode, bf16, a 1 GiB
host tier. Rows:

- vLLM took the KV layout KVBM asks for (BLHNC): the worker's startup line
  says a page of 16 consecutive blocks is one copy (and which copy path and
  round-trip GB/s it measured);
- a 1000-token prompt computed with neither load nor store (the reference),
  then computed again and stored, then, after vLLM's own prefix cache is
  reset, onboarded from the host tier: its 768 tokens of full pages come from
  KVBM, and its 16 greedy tokens equal the reference's;
- vLLM's own prefix-cache hit of the same prompt, for comparison.

The engine runs in a child process (this file with ``--child``), its engine
core in that process too (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): a hang or a
crash ends only this case, and the child is killed at the check's deadline.
The child prints its rows as tab-separated lines; the parent reports them as
they come. The model is ``--vllm-model`` or, without network, a small
random-weight Llama built here (vllm_kvbm/tools/local_model.py, with logits
far apart so greedy tokens do not hinge on rounding).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import queue
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

NAME = "vllm"
REPO = Path(__file__).resolve().parent.parent
BLOCK_SIZE = 16
CPU_BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32 only
PAGE_TOKENS = 256  # KVBM's default page at blocks under 128 tokens
PROMPT_TOKENS = 1000
MAX_TOKENS = 16
CASE_S = 150.0  # at most, of the check's budget
LEFT_FOR_OTHERS_S = 70.0  # of the budget, for the cases after this one (peer-read: 20-30 s)
# A request's kv_transfer_params that neither load nor store: a recompute.
RECOMPUTE = {"max_load_tokens": 0, "lmcache.skip_save": True}


def run_vllm(args, device, report, deadline: float) -> None:
    """Runs the child and reports its rows as they come."""
    if device.type != "cuda" and not args.vllm_cpu:
        report.info(NAME, "skipped", "a CPU run (--vllm-cpu runs it on vLLM's CPU build)")
        return
    try:
        found = importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        report.info(NAME, "skipped", "vLLM is not installed here")
        return
    left = deadline - time.perf_counter() - LEFT_FOR_OTHERS_S
    if left < min(30.0, args.vllm_timeout_s):
        report.info(NAME, "skipped", "too little of the time budget is left")
        return
    report_child(report, child_command(args, device), min(args.vllm_timeout_s, left))


def child_command(args, device) -> list[str]:
    cmd = [sys.executable, __file__, "--child", "--device", device.type]
    return cmd + (["--model", args.vllm_model] if args.vllm_model else [])


def report_child(
    report, cmd: list[str], timeout: float, name: str = NAME, finished: str = "engine run finished"
) -> None:
    """Runs ``cmd``, reporting its rows as they come (as case ``name``); killed
    after ``timeout`` (with its process group: what it started too). The last
    row, ``finished``, says whether it ended by itself with exit status 0."""
    log = tempfile.NamedTemporaryFile(prefix=f"kvbm-gpu-check-{name}-", suffix=".log", delete=False)
    env = {
        **os.environ,
        "VLLM_LOGGING_STREAM": "ext://sys.stderr",  # stdout: the rows
        "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env, start_new_session=True
    )
    rows: queue.Queue = queue.Queue()
    threading.Thread(
        target=lambda: [rows.put(line) for line in proc.stdout] + [rows.put(None)], daemon=True
    ).start()
    end, seen = time.perf_counter() + timeout, 0
    while True:
        try:
            if time.perf_counter() > end:
                raise queue.Empty
            line = rows.get(timeout=max(0.05, end - time.perf_counter()))
        except queue.Empty:
            os.killpg(proc.pid, signal.SIGKILL)
            report.check(name, finished, False, f"killed after {timeout:.0f} s; {_tail(log.name)}")
            break
        if line is None:
            rc = proc.wait()
            report.check(
                name,
                finished,
                rc == 0 and seen > 0,
                f"exit status {rc}" + (f"; {_tail(log.name)}" if rc else ""),
            )
            break
        parts = line.rstrip("\n").split("\t")
        if len(parts) != 4 or parts[0] != "ROW":
            log.write(line.encode(errors="replace"))  # anything else printed: into the log
            log.flush()
        else:
            seen += 1
            _, what, status, detail = parts
            if status == "info":
                report.info(name, what, detail)
            else:
                report.check(name, what, status == "PASS", detail)
    proc.wait()
    log.close()
    os.unlink(log.name)


def _tail(path: str, lines: int = 3) -> str:
    with open(path, errors="replace") as f:
        text = [x.strip() for x in f.read().splitlines() if x.strip()]
    return "log: " + " | ".join(text[-lines:]) if text else "no log"


# ---- the child -------------------------------------------------------------------


def _row(what: str, status: str, detail: str) -> None:
    detail = " ".join(detail.split())  # one line
    print(f"ROW\t{what}\t{status}\t{detail}", flush=True)


def _check(what: str, ok: bool, detail: str) -> None:
    _row(what, "PASS" if ok else "FAIL", detail)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def child(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--child", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default=None)
    args = p.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    kvbm_log = _Lines()
    logging.getLogger("vllm_kvbm").addHandler(kvbm_log)
    logging.getLogger("vllm_kvbm").setLevel(logging.INFO)
    sys.path.insert(0, str(REPO))
    from vllm import LLM, SamplingParams

    from vllm_kvbm.tools.server import kvbm_transfer_config

    model = args.model
    if model is None:
        from vllm_kvbm.tools.local_model import DEFAULT_DIR, build

        t = time.perf_counter()
        out = REPO / DEFAULT_DIR
        if not os.access(out.parent if out.parent.exists() else REPO, os.W_OK):
            out = Path(tempfile.gettempdir()) / "kvbm-gpu-check-model"
        model = str(build(out))
        _row(
            "model",
            "info",
            f"{model}: built here (random weights) in {time.perf_counter() - t:.0f} s",
        )
    t = time.perf_counter()
    block_size = BLOCK_SIZE if args.device == "cuda" else CPU_BLOCK_SIZE
    llm = LLM(
        model=model,
        dtype="bfloat16",
        block_size=block_size,
        max_model_len=2048,
        max_num_batched_tokens=2048,
        enforce_eager=True,
        enable_prefix_caching=True,
        gpu_memory_utilization=0.3,
        kv_cache_memory_bytes=1 << 30,
        seed=0,
        kv_transfer_config=kvbm_transfer_config(host_cache_size="1GiB"),
    )
    _row(
        "engine",
        "info",
        f"{model}, block size {block_size}, bf16, eager: started in "
        f"{time.perf_counter() - t:.0f} s",
    )
    line = next((x for x in kvbm_log.lines if "engine<->host copies by" in x), "")
    resolved = getattr(llm.llm_engine.vllm_config.cache_config, "kv_cache_layout", None)
    one_copy = f"a {PAGE_TOKENS // block_size}-block page is 1 copy" in line
    _row("worker's startup line", "info", line or "not seen")
    if args.device == "cuda":
        _check(
            "vLLM took BLHNC (a page of consecutive blocks one copy)",
            one_copy and "laid out layer by layer" not in line,
            f"cache_config.kv_cache_layout={resolved}",
        )
    else:
        _row("KV layout", "info", f"{resolved} (KVBM asks for BLHNC on CUDA only)")

    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(0)
    prompt = {
        "prompt_token_ids": [rng.randrange(10, min(vocab, 7000)) for _ in range(PROMPT_TOKENS)]
    }

    def generate(params=None):
        sp = SamplingParams(
            temperature=0.0,
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
            extra_args={"kv_transfer_params": params} if params else None,
        )
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        return list(out.outputs[0].token_ids), out.num_cached_tokens

    reference, _ = generate(RECOMPUTE)  # computed, nothing loaded or stored
    llm.reset_prefix_cache()
    generate()  # computed again, its full pages stored into the host tier
    llm.reset_prefix_cache()  # vLLM's own cache forgets the prompt; KVBM's host tier not
    hit, cached = generate()
    expected = (PROMPT_TOKENS - 1) // PAGE_TOKENS * PAGE_TOKENS
    _check(
        "host hit: the prompt's full pages onboarded",
        cached == expected,
        f"{cached} of {PROMPT_TOKENS} prompt tokens from the host tier (its full pages: "
        f"{expected})",
    )
    _check(
        "host hit equals recompute (greedy tokens)",
        hit == reference,
        f"{sum(a == b for a, b in zip(hit, reference))}/{MAX_TOKENS} tokens equal",
    )
    own, own_cached = generate()  # vLLM's own prefix cache this time
    _row(
        "vLLM's own prefix-cache hit",
        "info",
        f"{own_cached} tokens cached; tokens equal to the recompute: {own == reference}",
    )
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as err:  # noqa: BLE001 - the rows are out; the process ends anyway
        _row("engine shutdown", "info", f"{type(err).__name__}: {err}")
    return 0


if __name__ == "__main__":
    sys.exit(child(sys.argv[1:]))
