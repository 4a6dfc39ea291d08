#!/usr/bin/env bash
# Does the simulator predict a real run? Calibrate on workload A, then run workload B (another seed, mix and
# rate) for real and simulated, and print the prediction errors. The machine's load is printed between phases:
# timings taken while other processes compute are noisy, so run it on a quiet machine when you can.
#   bash scripts/sim_validate.sh OUT_DIR [A: a trace name or file]
set -euo pipefail
cd "$(dirname "$0")/.."
C=.venv/bin/conveyor
OUT=${1:-out/sim-validate}
A=${2:-longtail_v1}  # a packaged trace name, or a trace file
mkdir -p "$OUT"
load() { echo "$1 $(date +%T) loadavg $(cut -d' ' -f1-3 /proc/loadavg)"; }
B=$OUT/workload_b.json
$C bench workload longtail --num-requests 40 --seed 2 --rag-fraction 0.1 --request-rate 1 --out "$B"
KNOBS=(--policies static,continuous,chunked --max-num-seqs 16 --max-num-batched-tokens 256 --max-model-len 2048
       --no-plots)
load start
$C sim calibrate --num-threads 1 --repeats "${REPEATS:-2}" --workload "$A" --out "$OUT/profile.json"
load calibrated
$C bench compare --workload "$B" "${KNOBS[@]}" --num-threads 1 --out "$OUT/real"
load "real runs done"
$C bench compare --workload "$B" "${KNOBS[@]}" --simulate "$OUT/profile.json" --out "$OUT/sim"
$C sim errors "$OUT/real/results.json" "$OUT/sim/results.json" | tee "$OUT/errors.txt"
