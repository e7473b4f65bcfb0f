#!/usr/bin/env bash
# Packaging smoke (CI, before the suite): builds the wheel, installs it
# non-editable into a fresh venv and, from outside the repository, imports it,
# resolves the plugin name KVBMConnector and runs one engine step with it.
# The fresh venv reuses the suite's dependencies, already resolved in .venv,
# through a .pth line (a plain path: .venv's own .pth files, such as its
# editable install of this repository, are not processed); the wheel goes in
# with --no-deps and the smoke checks that its declared requirements are met,
# at the versions the lock (constraints-cpu.txt, as setup.sh; KVBM_CONSTRAINTS)
# pins.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${VENV:-.venv}
LOCK=${KVBM_CONSTRAINTS:-constraints-cpu.txt}
PIN=()
[ "$LOCK" = none ] || { LOCK=$(realpath "$LOCK"); PIN=(-c "$LOCK"); }
bash scripts/setup.sh
"$VENV/bin/python" -m vllm_kvbm.tools.local_model >/dev/null
WORK=$(mktemp -d /tmp/kvbm-wheel-smoke.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
"$VENV/bin/python" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/dist" . >/dev/null
WHEEL=$(ls "$WORK"/dist/vllm_kvbm-*.whl)
"$VENV/bin/python" -m venv "$WORK/venv"
SUITE_SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
NEW_SITE=$("$WORK/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$SUITE_SITE" > "$NEW_SITE/kvbm-suite-deps.pth"
"$WORK/venv/bin/python" -m pip install -q ${PIN[@]+"${PIN[@]}"} --no-deps --no-index "$WHEEL"
# the wheel carries the entry point and the license. The listings are read
# whole first: `unzip | grep -q` under pipefail fails with SIGPIPE (141)
# whenever grep quits before unzip has written its last line.
LISTING=$(unzip -l "$WHEEL")
ENTRY_POINTS=$(unzip -p "$WHEEL" '*.dist-info/entry_points.txt')
grep -q "vllm_kvbm-.*dist-info/entry_points.txt" <<<"$LISTING"
grep -q "vllm_kvbm.plugin:register" <<<"$ENTRY_POINTS"
grep -q "dist-info/licenses/LICENSE" <<<"$LISTING"
cd "$WORK"
env -u PYTHONPATH KVBM_HOST_CACHE_SIZE=64MiB VLLM_CPU_KVCACHE_SPACE=1 KVBM_SMOKE_LOCK="$LOCK" \
  "$WORK/venv/bin/python" "$ROOT/scripts/wheel_smoke.py" "$ROOT/models/kvbm-llama-8l"
