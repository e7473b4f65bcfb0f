#!/usr/bin/env bash
# LMCache's LMBenchmark (synthetic-multi-round-qa) against plain vLLM and vLLM + KVBM,
# one server at a time, as Dynamo's KVBM docs describe. For users with a checkout of
# https://github.com/LMCache/LMBenchmark (it is not on PyPI); kvbm-bench (this package)
# runs the same workload without it.
#
#   LMBENCHMARK_DIR=~/LMBenchmark examples/lmbenchmark/run.sh MODEL [qps ...]
#   examples/lmbenchmark/run.sh --sizes [MODEL]    # print what would run, start nothing
#   examples/lmbenchmark/run.sh --check-cores LOG...  # the cores each server log ran on
#
# It runs LMBenchmark's client (synthetic-multi-round-qa/multi-round-qa.py) with the flags
# of its long_input_short_output_run.sh: N users x N rounds, a shared system prompt, a
# per-user history, 100-token answers, --time seconds per QPS value, one
# <key>_output_<qps>.csv per QPS value. That script's sizes (15 users x 20 rounds,
# 20000-token histories, a 16GiB host tier) are the default only with a GPU; on a CPU-only
# machine they are scaled to its cores and memory (--sizes prints them). Every size can be
# set:
#   NUM_USERS, NUM_ROUNDS, SYSTEM_PROMPT, CHAT_HISTORY, ANSWER_LEN (tokens), DURATION (s)
#   HOST_CACHE (host tier, e.g. "4GiB"), KV_CACHE_BYTES (engine KV cache; unset: vLLM's own
#   sizing, the default with a GPU), MAX_MODEL_LEN (default: what the workload needs)
# Other env: PORT (8000), OUT (results dir, ./lmbenchmark-results), SERVE_ARGS (extra
# vllm serve args), STARTUP_TIMEOUT (s, 900), VLLM (default: this repo's .venv/bin/vllm),
# CLIENT_PYTHON (default: this repo's .venv/bin/python; pandas and openai, what the client
# imports, are pip-installed into it when missing, unless INSTALL_CLIENT_DEPS=0).
# Both servers get the same CPU binding: vLLM CPU reserves one more core for an engine with
# a kv_transfer_config, so by default a 2-core machine would run the baseline on one core
# and KVBM on two. VLLM_CPU_NUM_OF_RESERVED_CPU=1 is exported for both unless
# VLLM_CPU_OMP_THREADS_BIND or VLLM_CPU_NUM_OF_RESERVED_CPU is set; each server's cores are
# read from its log ("core ids=") and printed, and a run whose servers used different cores
# ends with an error (its CSVs are kept, and $OUT/CORES_DIFFER says why).
# Anything missing or failing stops the run with a message: a server that exits, a client
# that fails, a client that exits 0 without writing its CSV.
# Servers listen on 127.0.0.1 only.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
fail() { echo "run.sh: error: $*" >&2; exit 1; }

# The cores vLLM bound a server's OpenMP threads to, from its log ("local_rank=0, core
# ids=[0]" under "OpenMP thread binding info"); "unknown" when the log has no such line.
cores_of() {
  local c
  c=$(sed -n 's/.*local_rank=\([0-9]*\), core ids=\(\[[0-9, ]*\]\).*/rank \1 cores \2/p' "$1" 2>/dev/null | paste -sd';' -)
  echo "${c:-unknown}"
}
if [ "${1:-}" = "--check-cores" ]; then
  shift
  [ $# -ge 1 ] || { echo "usage: $0 --check-cores LOG..." >&2; exit 2; }
  first=$(cores_of "$1"); same=1
  for log in "$@"; do
    c=$(cores_of "$log"); echo "$log: $c"
    if [ "$c" != "$first" ] || [ "$c" = unknown ]; then same=0; fi
  done
  [ $same = 1 ] || fail "the servers did not run on the same cores: not a fair comparison"
  exit 0
fi

SIZES_ONLY=0
if [ "${1:-}" = "--sizes" ]; then SIZES_ONLY=1; shift; fi
if [ $SIZES_ONLY = 0 ] && [ $# -lt 1 ]; then
  echo "usage: LMBENCHMARK_DIR=PATH $0 MODEL [qps ...]   (or: $0 --sizes [MODEL])" >&2
  exit 2
fi
MODEL=${1:-MODEL}
[ $# -gt 0 ] && shift
QPS=("${@:-0.1}")

# ---- sizes from the machine ------------------------------------------------------------
cores=$(nproc 2>/dev/null || echo 2)
mem_gib=$(awk '/^MemTotal:/ {print int($2 / 1048576)}' /proc/meminfo 2>/dev/null || echo 8)
[ "$mem_gib" -ge 1 ] || mem_gib=1
gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then gpu=1; fi
min() { if [ "$1" -lt "$2" ]; then echo "$1"; else echo "$2"; fi; }
max() { if [ "$1" -gt "$2" ]; then echo "$1"; else echo "$2"; fi; }
if [ $gpu = 1 ]; then
  # LMBenchmark's long_input_short_output_run.sh as it is.
  : "${NUM_USERS:=15}" "${NUM_ROUNDS:=20}" "${CHAT_HISTORY:=20000}"
  : "${HOST_CACHE:=$(min 16 $(max 1 $((mem_gib / 4))))GiB}"
else
  # CPU prefill runs at a few thousand tokens/s at best: histories of 1000 tokens per
  # core, a user per core; host tier a quarter of RAM (at most 16GiB), engine KV cache a
  # quarter of that, so returning users are served from the host tier.
  : "${NUM_USERS:=$(min 15 $(max 2 "$cores"))}" "${NUM_ROUNDS:=$(min 20 $(max 4 $((2 * cores))))}"
  : "${CHAT_HISTORY:=$(min 20000 $((1000 * cores)))}"
  host_gib=$(min 16 $(max 1 $((mem_gib / 4))))
  : "${HOST_CACHE:=${host_gib}GiB}"
  : "${KV_CACHE_BYTES:=$(( (host_gib * 1073741824) / 4 ))}"
fi
: "${SYSTEM_PROMPT:=1000}" "${ANSWER_LEN:=100}" "${DURATION:=100}"
# Prompt of the last round: system prompt + history + every earlier question and answer.
: "${MAX_MODEL_LEN:=$(( SYSTEM_PROMPT + CHAT_HISTORY + NUM_ROUNDS * (ANSWER_LEN + 40) + 256 ))}"
if [ -z "${VLLM_CPU_OMP_THREADS_BIND:-}" ] && [ -z "${VLLM_CPU_NUM_OF_RESERVED_CPU:-}" ]; then
  export VLLM_CPU_NUM_OF_RESERVED_CPU=1  # what vLLM gives the baseline; KVBM gets the same
fi
CPU_ENV="VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-auto} VLLM_CPU_NUM_OF_RESERVED_CPU=${VLLM_CPU_NUM_OF_RESERVED_CPU:-vLLM default}"
PORT=${PORT:-8000}
STARTUP_TIMEOUT=${STARTUP_TIMEOUT:-900}
VLLM=${VLLM:-$ROOT/.venv/bin/vllm}
CLIENT_PYTHON=${CLIENT_PYTHON:-$ROOT/.venv/bin/python}
OUT=${OUT:-$PWD/lmbenchmark-results}
case $OUT in /*) ;; *) OUT=$PWD/$OUT ;; esac

SERVE=("$VLLM" serve "$MODEL" --host 127.0.0.1 --port "$PORT" --max-model-len "$MAX_MODEL_LEN")
if [ -n "${KV_CACHE_BYTES:-}" ]; then SERVE+=(--kv-cache-memory-bytes "$KV_CACHE_BYTES"); fi
KVBM_CONFIG=$(printf '{"kv_connector":"KVBMConnector","kv_connector_module_path":"vllm_kvbm.connector","kv_role":"kv_both","kv_connector_extra_config":{"host_cache_size":"%s"}}' "$HOST_CACHE")

if [ $SIZES_ONLY = 1 ]; then
  echo "machine: $cores cores, ${mem_gib}GiB RAM, $([ $gpu = 1 ] && echo GPU || echo 'no GPU')"
  echo "workload: NUM_USERS=$NUM_USERS NUM_ROUNDS=$NUM_ROUNDS SYSTEM_PROMPT=$SYSTEM_PROMPT CHAT_HISTORY=$CHAT_HISTORY ANSWER_LEN=$ANSWER_LEN DURATION=$DURATION QPS=${QPS[*]}"
  echo "tiers: HOST_CACHE=$HOST_CACHE KV_CACHE_BYTES=${KV_CACHE_BYTES:-vLLM default}"
  echo "server: ${SERVE[*]} ${SERVE_ARGS:-}"
  echo "cpu binding (both servers): $CPU_ENV"
  echo "results: $OUT"
  exit 0
fi

# ---- what it needs, checked before anything starts ---------------------------------------
[ -n "${LMBENCHMARK_DIR:-}" ] || fail "LMBENCHMARK_DIR is not set: set it to a checkout of LMCache/LMBenchmark (git clone https://github.com/LMCache/LMBenchmark), e.g. LMBENCHMARK_DIR=~/LMBenchmark $0 $MODEL"
case $LMBENCHMARK_DIR in /*) lmb_abs=$LMBENCHMARK_DIR ;; *) lmb_abs=$PWD/$LMBENCHMARK_DIR ;; esac
[ -d "$lmb_abs" ] || fail "LMBENCHMARK_DIR=$LMBENCHMARK_DIR: no such directory ($lmb_abs)"
LMBENCHMARK_DIR=$(cd "$lmb_abs" && pwd)
QA_DIR=$LMBENCHMARK_DIR/synthetic-multi-round-qa
CLIENT=$QA_DIR/multi-round-qa.py
[ -f "$CLIENT" ] || fail "LMBENCHMARK_DIR=$LMBENCHMARK_DIR is not an LMBenchmark checkout: $CLIENT not found"
[ -x "$VLLM" ] || fail "vllm not found at $VLLM: install this repo first (./scripts/demo.sh or ./scripts/test.sh create .venv), or set VLLM"
[ -x "$CLIENT_PYTHON" ] || CLIENT_PYTHON=$(command -v python3) || fail "no python3 for LMBenchmark's client"
missing=$("$CLIENT_PYTHON" -c 'import importlib.util as u; print(*[m for m in ("openai", "pandas") if u.find_spec(m) is None])') ||
  fail "CLIENT_PYTHON=$CLIENT_PYTHON does not run"
if [ -n "$missing" ]; then
  [ "${INSTALL_CLIENT_DEPS:-1}" = 1 ] ||
    fail "LMBenchmark's client needs $missing, missing from $CLIENT_PYTHON (INSTALL_CLIENT_DEPS=0: not installing); pip install $missing, or set CLIENT_PYTHON"
  echo "== installing what LMBenchmark's client imports ($missing) into $CLIENT_PYTHON's environment"
  # shellcheck disable=SC2086  # one word per module
  "$CLIENT_PYTHON" -m pip install --quiet $missing ||
    fail "could not install $missing for $CLIENT_PYTHON; install it, or set CLIENT_PYTHON"
fi
mkdir -p "$OUT"
(cd "$QA_DIR" && "$CLIENT_PYTHON" "$CLIENT" --help) >"$OUT/client-check.log" 2>&1 ||
  fail "LMBenchmark's client does not start with $CLIENT_PYTHON: $(tail -1 "$OUT/client-check.log") (log: $OUT/client-check.log)"

SERVER_PID=
stop_server() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -INT -- "-$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
  fi
  SERVER_PID=
}
trap stop_server EXIT

run_one() {  # $1: name, rest: extra vllm serve args
  local name=$1; shift
  echo "== $name: starting vllm serve on 127.0.0.1:$PORT (log: $OUT/server-$name.log)"
  # setsid: the server and its engine-core children in one process group
  # shellcheck disable=SC2086  # SERVE_ARGS is a list of words
  setsid "${SERVE[@]}" ${SERVE_ARGS:-} "$@" >"$OUT/server-$name.log" 2>&1 &
  SERVER_PID=$!
  local deadline=$((SECONDS + STARTUP_TIMEOUT))
  until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
    kill -0 "$SERVER_PID" 2>/dev/null || { SERVER_PID=; tail -20 "$OUT/server-$name.log" >&2; fail "$name: vllm serve exited; see $OUT/server-$name.log"; }
    [ $SECONDS -lt $deadline ] || { stop_server; fail "$name: vllm serve not ready after ${STARTUP_TIMEOUT}s; see $OUT/server-$name.log"; }
    sleep 2
  done
  echo "== $name: OpenMP threads on $(cores_of "$OUT/server-$name.log") ($CPU_ENV)"
  local user_id=1 qps csv
  for qps in "${QPS[@]}"; do
    csv=$OUT/${name}_output_${qps}.csv
    rm -f "$csv"
    echo "== $name: LMBenchmark multi-round QA at $qps QPS for ${DURATION}s (log: $OUT/client-${name}_${qps}.log)"
    # the base URL as LMBenchmark's own scripts pass it (its client adds /v1)
    (cd "$QA_DIR" &&
     "$CLIENT_PYTHON" "$CLIENT" --num-users "$NUM_USERS" --num-rounds "$NUM_ROUNDS" --qps "$qps" \
       --shared-system-prompt "$SYSTEM_PROMPT" --user-history-prompt "$CHAT_HISTORY" \
       --answer-len "$ANSWER_LEN" --model "$MODEL" --base-url "http://127.0.0.1:$PORT" \
       --init-user-id "$user_id" --output "$csv" --log-interval 30 --time "$DURATION") \
      >"$OUT/client-${name}_${qps}.log" 2>&1 ||
      { tail -20 "$OUT/client-${name}_${qps}.log" >&2; fail "$name: LMBenchmark's client failed at $qps QPS; see $OUT/client-${name}_${qps}.log"; }
    [ -s "$csv" ] || fail "$name: LMBenchmark's client exited 0 but wrote no $csv; see $OUT/client-${name}_${qps}.log"
    user_id=$((user_id + 20))  # as long_input_short_output_run.sh: new users per QPS value
  done
  stop_server
}

rm -f "$OUT/CORES_DIFFER"
echo "== sizes: $NUM_USERS users x $NUM_ROUNDS rounds, system prompt $SYSTEM_PROMPT, history $CHAT_HISTORY, answers $ANSWER_LEN tokens; host tier $HOST_CACHE; engine KV ${KV_CACHE_BYTES:-vLLM default} bytes; max_model_len $MAX_MODEL_LEN"
run_one baseline
run_one kvbm --kv-transfer-config "$KVBM_CONFIG"
echo "results: $OUT/baseline_output_<qps>.csv and $OUT/kvbm_output_<qps>.csv"
base_cores=$(cores_of "$OUT/server-baseline.log"); kvbm_cores=$(cores_of "$OUT/server-kvbm.log")
if [ "$base_cores" != "$kvbm_cores" ] || [ "$base_cores" = unknown ]; then
  echo "baseline: $base_cores; kvbm: $kvbm_cores" >"$OUT/CORES_DIFFER"
  fail "NOT COMPARABLE: the servers ran on different cores (baseline: $base_cores; kvbm: $kvbm_cores); set the same VLLM_CPU_OMP_THREADS_BIND for both and run again"
fi
echo "both servers: OpenMP threads on $base_cores"
# Same columns as kvbm-bench's CSV; summarize either with:
echo "  $ROOT/.venv/bin/python -c 'import sys; from vllm_kvbm.bench.client import read_csv, summarize, format_summary; [print(f, format_summary(summarize(read_csv(f)))) for f in sys.argv[1:]]' $OUT/*_output_*.csv"
