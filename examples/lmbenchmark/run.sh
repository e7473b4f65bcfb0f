#!/usr/bin/env bash
# LMCache's LMBenchmark (synthetic-multi-round-qa) against plain vLLM and vLLM + KVBM,
# one server at a time, as Dynamo's KVBM docs describe. For users with a checkout of
# https://github.com/LMCache/LMBenchmark; kvbm-bench (this package) runs the same
# workload without it.
#
#   LMBENCHMARK_DIR=~/LMBenchmark examples/lmbenchmark/run.sh MODEL [qps ...]
#
# Env: LMBENCHMARK_DIR (required), PORT (8000), HOST_CACHE (host tier, "16GiB"),
# OUT (result prefix dir, ./lmbenchmark-results), SERVE_ARGS (extra vllm serve args),
# STARTUP_TIMEOUT (s, 900).
# LMBenchmark's script: long_input_short_output_run.sh <model> <base url> <save file key> [qps...]
# (15 users x 20 rounds, 1000-token system prompt, 20000-token history, 100-token answers);
# it writes <key>_output_<qps>.csv per QPS value.
set -euo pipefail
MODEL=${1:?usage: LMBENCHMARK_DIR=... $0 MODEL [qps ...]}
shift
QPS=("${@:-0.1}")
: "${LMBENCHMARK_DIR:?set LMBENCHMARK_DIR to a checkout of LMCache/LMBenchmark}"
RUN="$LMBENCHMARK_DIR/synthetic-multi-round-qa/long_input_short_output_run.sh"
[ -f "$RUN" ] || { echo "not found: $RUN" >&2; exit 1; }
PORT=${PORT:-8000}
OUT=${OUT:-$PWD/lmbenchmark-results}
HOST_CACHE=${HOST_CACHE:-16GiB}
STARTUP_TIMEOUT=${STARTUP_TIMEOUT:-900}
mkdir -p "$OUT"
KVBM_CONFIG=$(printf '{"kv_connector":"KVBMConnector","kv_connector_module_path":"vllm_kvbm.connector","kv_role":"kv_both","kv_connector_extra_config":{"host_cache_size":"%s"}}' "$HOST_CACHE")

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
  echo "== $name: starting vllm serve (log: $OUT/server-$name.log)"
  # setsid: the server and its engine-core children in one process group
  setsid vllm serve "$MODEL" --port "$PORT" ${SERVE_ARGS:-} "$@" >"$OUT/server-$name.log" 2>&1 &
  SERVER_PID=$!
  local deadline=$((SECONDS + STARTUP_TIMEOUT))
  until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "$name: server exited; see $OUT/server-$name.log" >&2; tail -20 "$OUT/server-$name.log" >&2; SERVER_PID=; return 1; }
    [ $SECONDS -lt $deadline ] || { echo "$name: not ready after ${STARTUP_TIMEOUT}s" >&2; stop_server; return 1; }
    sleep 2
  done
  (cd "$LMBENCHMARK_DIR/synthetic-multi-round-qa" &&
   bash "$RUN" "$MODEL" "http://127.0.0.1:$PORT" "$OUT/$name" "${QPS[@]}")
  stop_server
}

run_one baseline
run_one kvbm --kv-transfer-config "$KVBM_CONFIG"
echo "results: $OUT/baseline_output_<qps>.csv and $OUT/kvbm_output_<qps>.csv"
# Same columns as kvbm-bench's CSV; summarize either with:
echo "  python -c 'import sys; from vllm_kvbm.bench.client import read_csv, summarize, format_summary; [print(f, format_summary(summarize(read_csv(f)))) for f in sys.argv[1:]]' $OUT/*_output_*.csv"
