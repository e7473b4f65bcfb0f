"""``kvbm-bench``: multi-round | doc-qa | compare."""

from __future__ import annotations

import importlib.util
import sys

USAGE = ("usage: kvbm-bench [--version] {multi-round,doc-qa,compare} [options]\n"
         "  multi-round  synthetic multi-round QA against --base-url\n"
         "  doc-qa       long document QA against --base-url\n"
         "  compare      start each server configuration in turn and compare them\n"
         "each subcommand takes --help")

# Modules of the [bench] extra each subcommand imports (tqdm comes with vLLM,
# but a plain install of the package need not have it).
NEEDS = {
    "multi-round": ("aiohttp", "tqdm"),
    "doc-qa": ("aiohttp", "tqdm"),
    "compare": ("aiohttp", "tqdm", "matplotlib"),
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
    return (f"kvbm-bench {cmd} needs {', '.join(missing)} (the [bench] extra): "
            f'pip install "vllm-kvbm[bench] @ git+https://github.com/vllm-kvbm/vllm-kvbm'
            f'@v{version()}"')


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"kvbm-bench {version()}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in NEEDS:
        print(f"unknown command {cmd!r}\n{USAGE}", file=sys.stderr)
        return 2
    # Checked before anything starts: compare would otherwise run every
    # configuration and fail only when it draws the plots.
    problem = missing_extra(cmd)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    if cmd == "compare":
        from vllm_kvbm.bench.compare import main as compare_main

        return compare_main(rest)
    from vllm_kvbm.bench.client import main as client_main

    return client_main(rest, cmd)


if __name__ == "__main__":
    sys.exit(main())
