"""``kvbm-bench``: multi-round | doc-qa | compare."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = ("usage: kvbm-bench {multi-round,doc-qa,compare} [options]\n"
             "  multi-round  synthetic multi-round QA against --base-url\n"
             "  doc-qa       long document QA against --base-url\n"
             "  compare      start each server configuration in turn and compare them\n"
             "each subcommand takes --help")
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd in ("multi-round", "doc-qa"):
        from vllm_kvbm.bench.client import main as client_main

        return client_main(rest, cmd)
    if cmd == "compare":
        from vllm_kvbm.bench.compare import main as compare_main

        return compare_main(rest)
    print(f"unknown command {cmd!r}\n{usage}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
