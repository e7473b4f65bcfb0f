"""``kvbm-bench``: multi-round | doc-qa | compare (``cli.py`` holds the options)."""

from __future__ import annotations

import importlib.util
import sys

# Modules of the [bench] extra each subcommand imports (openai, psutil and tqdm
# come with vLLM, but a plain install of the package need not have them).
NEEDS = {
    "multi-round": ("openai", "tqdm"),
    "doc-qa": ("openai", "tqdm"),
    "compare": ("openai", "tqdm", "psutil", "matplotlib"),
}


def version() -> str:
    from vllm_kvbm import __version__

    return __version__


def missing_extra(cmd: str) -> str | None:
    """The error for a subcommand whose [bench] modules are not importable."""
    missing = [m for m in NEEDS[cmd] if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    # The package is not on PyPI: the extra comes from this release's tag (or,
    # in a checkout, pip install -e ".[bench]").
    return (
        f"kvbm-bench {cmd} needs {', '.join(missing)} (the [bench] extra): "
        f'pip install "vllm-kvbm[bench] @ git+https://github.com/vllm-kvbm/vllm-kvbm'
        f'@v{version()}"'
    )


def main(argv: list[str] | None = None) -> int:
    from vllm_kvbm.bench.cli import build_parser, finish

    argv = list(sys.argv[1:] if argv is None else argv)
    # what follows the first -- goes to every vllm serve compare starts
    own, passthrough = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    parser = build_parser()
    try:
        args = parser.parse_args(own)  # bad arguments: usage, the error, 2; --help: 0
    except SystemExit as exit_:
        return exit_.code or 0
    if args.version:
        print(f"kvbm-bench {version()}")
        return 0
    if args.command is None:
        parser.print_usage(sys.stderr)
        print(
            "kvbm-bench: error: name a command (multi-round, doc-qa or compare); "
            "kvbm-bench --help lists them, with examples",
            file=sys.stderr,
        )
        return 2
    # Checked before anything starts: compare would otherwise run every
    # configuration and fail only when it draws the plots.
    problem = missing_extra(args.command)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    try:
        finish(parser.commands[args.command], args, passthrough)
    except SystemExit as exit_:
        return exit_.code or 0
    try:
        if args.command == "compare":
            from vllm_kvbm.bench.compare import main as compare_main

            return compare_main(args, argv[1:])
        from vllm_kvbm.bench.client import main as client_main

        return client_main(args)
    except KeyboardInterrupt:
        print(f"kvbm-bench {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
