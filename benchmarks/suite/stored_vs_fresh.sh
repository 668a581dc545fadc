#!/usr/bin/env bash
# A server that reads what earlier servers stored against one that measures afresh, windows alternating (the
# calibration issue: a stored refinement must serve within 10% of a fresh calibration). The machine drifts by a
# third within minutes; each window's one-row pass price (/metrics specdec_pass_priced_ms{rows="1"}) shows where.
#
#   benchmarks/pair.py stored-vs-fresh TARGET.gguf CACHE_DIR [LEVELS] [ROUNDS] [SECONDS]
#   benchmarks/pair.py stored-vs-fresh ~/.cache/specdec/pair/coder15.gguf /tmp/sc 1,4,8 2 15
#
# CACHE_DIR is what the stored servers read (and refine when they stop); the fresh ones run on a copy of it made at
# the start, with SPECDEC_REMEASURE=1. Results: one JSON line per window on stdout.
set -euo pipefail
target=$1 cache=$2 levels=${3:-1,4,8} rounds=${4:-2} seconds=${5:-15}
here=$(cd "$(dirname "$0")" && pwd)
copy=$(mktemp -d)
cp -r "$cache"/. "$copy"/
trap 'rm -rf "$copy"' EXIT
window() {  # name cache env
  local port log
  port=$(python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  log=$(mktemp)
  env SPECDEC_CACHE="$2" $3 HF_HUB_OFFLINE=1 python -m specdec.cli serve --port "$port" --target "$target" \
    --max-queue 64 > "$log.server" 2>&1 &
  local pid=$!
  until curl -sf "localhost:$port/health" > /dev/null; do sleep 0.3; done
  python "$here/load.py" --url "http://127.0.0.1:$port" --levels "$levels" --duration "$seconds" --malformed 0 \
    --no-identity --out "$log.json" > /dev/null 2>&1
  local one_row
  one_row=$(curl -s "localhost:$port/metrics" | sed -n 's/^specdec_pass_priced_ms{rows="1"} //p')
  kill "$pid"; wait "$pid" || true
  python - "$1" "$log.json" "$one_row" <<'PY'
import json, sys
name, path, one_row = sys.argv[1], sys.argv[2], float(sys.argv[3] or "nan")
for lv in json.load(open(path))["levels"]:
    print(json.dumps({"server": name, "streams": lv["concurrency"], "tokens_per_s": lv["tokens_per_s"],
                      "ttft_p50_s": lv["ttft_p50_s"], "one_row_ms": round(one_row, 2)}))
PY
  rm -f "$log" "$log.json" "$log.server"
}
for r in $(seq "$rounds"); do
  window stored "$cache" ""
  window fresh "$copy" "SPECDEC_REMEASURE=1"
done
