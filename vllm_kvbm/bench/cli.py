"""``kvbm-bench``'s command line: the subcommands, their argument groups, the
checks on every value (a bad one exits 2 naming the flag and the fix), the
examples and the exit codes ``--help`` prints."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap

from vllm_kvbm.bench.arg_values import base_url, count, fraction, named_url, positive, size
from vllm_kvbm.bench.serve_args import defaults

EXIT_CODES = """exit codes:
  0    the run finished: every request of every configuration answered
  1    a run failed: a request failed or timed out, a server did not start or
       could not be reached (each configuration's cause is in the report)
  2    bad arguments, a missing [bench] extra, or no configuration this
       platform can run
  3    compare: every configuration ran, but not on the same CPU cores (the
       report says NOT COMPARABLE and names each one's cores)
  130  interrupted (Ctrl-C); the servers kvbm-bench started are stopped"""

WORKLOADS = ("multi-round", "doc-qa")
CONFIGS = [
    "vllm",
    "kvbm-host",
    "kvbm-host-disk",
    "vllm-offload",
    "offloading-connector",
    "simple-cpu-offload",
    "lmcache",
]


# ---- help --------------------------------------------------------------------------


def _no_default(action) -> bool:
    # `is`, not `in`: a default of 0 equals False
    return (
        action.default is None
        or action.default is False
        or action.default is argparse.SUPPRESS
        or action.default == []
    )


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each option's default, except where its help already says it;
    descriptions and epilogs (examples, exit codes) as written."""

    def _format_action(self, action):
        # argparse prints nothing after an option without help, not even its default
        if action.help is None and action.option_strings and not _no_default(action):
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action):
        text = action.help or ""
        if "default:" in text or _no_default(action):
            return text
        return super()._get_help_string(action)


def _wrap(text: str) -> str:
    return textwrap.fill(text, 79)


def _epilog(examples: str) -> str:
    return f"examples:\n{examples}\n\n{EXIT_CODES}"


# ---- the options ---------------------------------------------------------------------


def add_workload_args(p, workload: str) -> None:
    """The workload's options; ``workload`` "both" for compare, where the
    options of either are taken and --workload picks which run."""
    g = p.add_argument_group("workload (the same seed gives the same prompts)")
    if workload == "both":
        g.add_argument(
            "--workload",
            choices=WORKLOADS,
            default="multi-round",
            help="multi-round: users in a chat, each round adds a question and "
            "the answer to the user's history; doc-qa: long documents, then "
            "passes where some return",
        )
    g.add_argument(
        "--qps",
        type=positive("--qps 0.5"),
        default=0.5,
        help="requests per second over all users (multi-round: LMBenchmark's "
        "pacing, a user's rounds num_users/qps seconds apart)",
    )
    g.add_argument(
        "--time",
        "--duration",
        dest="duration",
        type=positive("--time 600"),
        default=600,
        help="stop launching new requests after this many seconds",
    )
    g.add_argument(
        "--request-timeout",
        type=positive("--request-timeout 300"),
        default=300,
        help="seconds one request may take, from sending it to its last token",
    )
    g.add_argument("--seed", type=count("--seed 0", 0), default=0)
    both = workload == "both"
    if workload in ("multi-round", "both"):
        g.add_argument("--num-users", type=count("--num-users 6"), default=6)
        g.add_argument("--num-rounds", type=count("--num-rounds 4"), default=4)
        g.add_argument(
            "--shared-system-prompt",
            type=count("--shared-system-prompt 1536", 0),
            default=1536,
            help="tokens of the system prompt shared by all users",
        )
        g.add_argument(
            "--user-history-prompt",
            type=count("--user-history-prompt 512", 0),
            default=512,
            help="tokens of each user's own history before round 0",
        )
    if workload in ("doc-qa", "both"):
        g.add_argument("--num-documents", type=count("--num-documents 4"), default=4)
        g.add_argument(
            "--document-length",
            type=count("--document-length 2000"),
            default=2000,
            help="tokens per document",
        )
        g.add_argument(
            "--repeat-count",
            type=count("--repeat-count 2", 0),
            default=2,
            help="passes after the first, each of --num-documents requests",
        )
        g.add_argument(
            "--hit-ratio",
            type=fraction,
            default=0.5,
            help="the chance that a request of a later pass is a document seen "
            "before (else a new one)",
        )
    g.add_argument(
        "--answer-len",
        type=count("--answer-len 32"),
        default=None if both else (32 if workload == "multi-round" else 16),
        help="tokens generated per request (default: 32 for multi-round, 16 for doc-qa)"
        if both
        else "tokens generated per request",
    )


def add_client(sub) -> dict[str, argparse.ArgumentParser]:
    parsers = {}
    for workload, what, example in (
        (
            "multi-round",
            "synthetic multi-round QA (LMCache LMBenchmark's workload)",
            "  kvbm-bench multi-round --base-url http://127.0.0.1:8000\n"
            "  kvbm-bench multi-round --base-url http://gpu1:8000 --model meta-llama/"
            "Llama-3.1-8B-Instruct \\\n      --num-users 15 --num-rounds 20 --qps 0.5 "
            "--user-history-prompt 20000 --answer-len 100",
        ),
        (
            "doc-qa",
            "long document QA: documents, then passes in which some return",
            "  kvbm-bench doc-qa --base-url http://127.0.0.1:8000 --num-documents 8 "
            "--hit-ratio 1.0",
        ),
    ):
        p = sub.add_parser(
            workload,
            help=f"{what}, against a running server",
            description=_wrap(
                f"{what}, sent to one OpenAI-compatible server "
                "you run; writes a per-request CSV and a "
                "summary."
            ),
            epilog=_epilog(example),
            formatter_class=HelpFormatter,
        )
        g = p.add_argument_group("server")
        g.add_argument(
            "--base-url",
            required=True,
            type=base_url,
            help="the server's root, e.g. http://127.0.0.1:8000 (an API key, "
            "if it needs one: $OPENAI_API_KEY)",
        )
        g.add_argument(
            "--model", default=None, help="model name the server serves (default: the one it lists)"
        )
        g.add_argument(
            "--tokenizer",
            default=None,
            help="tokenizer to build prompts with (default: the model's)",
        )
        add_workload_args(p, workload)
        g = p.add_argument_group("output")
        g.add_argument(
            "--output",
            default=f"{workload}.csv",
            help="per-request CSV; the summary goes next to it as .summary.json",
        )
        parsers[workload] = p
    return parsers


def add_compare(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "compare",
        help="one workload against several servers, one after another",
        formatter_class=HelpFormatter,
        description=_wrap(
            "One workload against several server configurations, one after another, and one "
            "report (report.md, CSVs, plots). Either kvbm-bench starts each configuration in "
            "turn (--configs: the same model, serve arguments and CPU binding; arguments "
            "after -- go to every vllm serve), or it sends the workload to servers you run "
            "(--url NAME=URL, repeated: nothing is started)."
        ),
        epilog=_epilog(
            "  kvbm-bench compare             # every configuration, the local model (CPU)\n"
            "  kvbm-bench compare --configs vllm kvbm-host --model Qwen/Qwen3-8B \\\n"
            "      -- --gpu-memory-utilization 0.9 --max-model-len 32768     # a GPU\n"
            "  kvbm-bench compare --url plain=http://h1:8000 --url kvbm=http://h2:8000\n\n"
            "serve arguments (--configs):\n"
            + textwrap.fill(
                "--serve-defaults cpu, the default on vLLM's CPU build: every "
                "server gets " + " ".join(defaults("cpu", None, None)) + ": an "
                "engine KV cache too small for the default workload's users, so "
                "that returning prompts leave vLLM's own cache, as a GPU's does "
                "under load; --engine-kv-blocks and --block-size change the "
                "first four.",
                79,
                initial_indent="  ",
                break_on_hyphens=False,
                subsequent_indent="    ",
            )
            + "\n"
            "  --serve-defaults none, the default elsewhere: only --seed 0; vLLM sizes the\n"
            "    KV cache and picks the rest.\n"
            "  An argument after -- (or in --serve-arg) replaces the default of the same\n"
            "    flag: -- --gpu-memory-utilization 0.9 --no-enforce-eager"
        ),
    )
    g = p.add_argument_group("what to compare (one of)")
    which = g.add_mutually_exclusive_group()
    which.add_argument(
        "--configs",
        nargs="+",
        choices=CONFIGS,
        default=None,
        metavar="CONFIG",
        help="configurations kvbm-bench starts in turn, of "
        + ", ".join(CONFIGS)
        + " (default: all)",
    )
    which.add_argument(
        "--url",
        action="append",
        type=named_url,
        default=[],
        metavar="NAME=URL",
        help="a server you run (repeat for each): the workload is sent to each, nothing is started",
    )
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        default=None,
        help="model path or name (default: the local model; with --url: the one "
        "the first server lists)",
    )
    g.add_argument(
        "--tokenizer", default=None, help="tokenizer to build prompts with (default: the model's)"
    )
    g = p.add_argument_group("servers kvbm-bench starts (--configs)")
    g.add_argument(
        "--serve-defaults",
        choices=["cpu", "none"],
        default=None,
        help="cpu: a small engine KV cache, eager mode; none: vLLM's own (see "
        "'serve arguments' below; default: cpu on vLLM's CPU build, none "
        "elsewhere)",
    )
    g.add_argument(
        "--engine-kv-blocks",
        type=count("--engine-kv-blocks 48", 2),
        default=None,
        help="engine KV cache in blocks (--num-gpu-blocks-override; default: 48 "
        "with --serve-defaults cpu, room for about three requests of the default "
        "workload at once; vLLM's sizing with none)",
    )
    g.add_argument(
        "--block-size",
        type=count("--block-size 128"),
        default=None,
        help="tokens per block (default: 128 with --serve-defaults cpu, vLLM's own with none)",
    )
    g.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="ARGS",
        help="arguments for every vllm serve, e.g. --serve-arg=--enforce-eager or "
        "--serve-arg '--max-model-len 8192' (repeatable; or after --)",
    )
    g.add_argument(
        "--startup-timeout",
        type=positive("--startup-timeout 600"),
        default=300,
        help="seconds a server may take to start",
    )
    g.add_argument(
        "--run-unsupported",
        action="store_true",
        help="start configurations this platform does not support (marked "
        "'not supported' otherwise) and report how they fail",
    )
    g.add_argument(
        "--reserved-cpus",
        type=count("--reserved-cpus 1", 0),
        default=1,
        help="VLLM_CPU_NUM_OF_RESERVED_CPU for every configuration, unless "
        "VLLM_CPU_OMP_THREADS_BIND or VLLM_CPU_NUM_OF_RESERVED_CPU is set (then "
        "those, for every configuration); vLLM itself reserves one more core for "
        "an engine with a kv_transfer_config",
    )
    g = p.add_argument_group("host RAM and disk of the offloading configurations")
    g.add_argument(
        "--host-cache-size",
        type=size,
        default="1GiB",
        help="KVBM's host tier (kvbm-host) and vLLM's offloading buffer "
        "(vllm-offload, offloading-connector, simple-cpu-offload)",
    )
    g.add_argument(
        "--host-disk-host-blocks",
        type=count("--host-disk-host-blocks 24"),
        default=24,
        help="host tier blocks for kvbm-host-disk (smaller than the working set)",
    )
    g.add_argument("--disk-cache-size", type=size, default="2GiB")
    add_workload_args(p, "both")
    g = p.add_argument_group("LMBenchmark's own client (multi-round only)")
    g.add_argument(
        "--lmbenchmark-dir",
        default=os.environ.get("LMBENCHMARK_DIR") or None,
        help="a checkout of LMCache/LMBenchmark: also run its multi-round QA "
        "client against each configuration (default: $LMBENCHMARK_DIR)",
    )
    g.add_argument(
        "--lmbenchmark-python",
        default=os.environ.get("LMBENCHMARK_PYTHON") or sys.executable,
        help="python for LMBenchmark's client, with openai and pandas "
        "(default: $LMBENCHMARK_PYTHON, else this python)",
    )
    g.add_argument(
        "--lmbenchmark-time",
        type=count("--lmbenchmark-time 60", 0),
        default=0,
        help="seconds LMBenchmark's client runs (default: requests / qps)",
    )
    g = p.add_argument_group("output")
    g.add_argument("--out-dir", default=None, help="default: bench-results/compare-<time>")
    return p


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvbm-bench",
        formatter_class=HelpFormatter,
        description="LMBenchmark-style TTFT benchmarks of OpenAI-compatible servers, with and "
        "without KVBM.",
        epilog=_epilog(
            "  kvbm-bench multi-round --base-url http://127.0.0.1:8000\n"
            "  kvbm-bench compare --configs vllm kvbm-host\n"
            "  kvbm-bench compare --url plain=http://h1:8000 --url "
            "kvbm=http://h2:8000\n  kvbm-bench COMMAND --help"
        ),
    )
    p.add_argument("-V", "--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    p.commands = {**add_client(sub), "compare": add_compare(sub)}  # for finish()'s errors
    return p


def finish(p: argparse.ArgumentParser, args, passthrough: list[str]) -> None:
    """Checks between options (exit 2 through ``p.error``) and fills the
    defaults that depend on others."""
    args.serve_passthrough = passthrough
    if args.command != "compare":
        if passthrough:
            p.error("arguments after -- go to vllm serve: only compare --configs starts servers")
        return
    if args.answer_len is None:
        args.answer_len = 32 if args.workload == "multi-round" else 16
    if args.url:
        names = [n for n, _ in args.url]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            p.error(
                f"argument --url: the name {dup[0]!r} is given twice; name each server "
                "once, e.g. --url plain=http://h1:8000 --url kvbm=http://h2:8000"
            )
        started = [
            f
            for f in ("serve_defaults", "engine_kv_blocks", "block_size")
            if getattr(args, f) is not None
        ]
        started += ["serve_arg"] if args.serve_arg else []
        started += ["run_unsupported"] if args.run_unsupported else []
        if started or passthrough:
            what = f"argument --{started[0].replace('_', '-')}" if started else "arguments after --"
            p.error(
                f"{what}: set how kvbm-bench starts servers, and --url starts none: set "
                "them on your servers instead, or use --configs"
            )
    else:
        if args.configs is None:
            args.configs = list(CONFIGS)
        from vllm_kvbm.bench.serve_args import default_profile

        args.serve_defaults = args.serve_defaults or default_profile()
        if args.serve_defaults == "none" and args.engine_kv_blocks and not args.block_size:
            p.error(
                "argument --engine-kv-blocks: with --serve-defaults none give --block-size "
                "too (the longest prompt, --max-model-len, is computed from both)"
            )
    if args.lmbenchmark_dir and args.workload != "multi-round":
        p.error(
            "argument --lmbenchmark-dir: runs LMBenchmark's multi-round QA: use "
            "--workload multi-round, or leave it out (unset LMBENCHMARK_DIR)"
        )
