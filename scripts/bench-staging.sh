#!/usr/bin/env bash
# Stall and time to durable against the staging bound (`ckpt-train --staging`): the reference
# workload saved through pools from "the whole state" down to one chunk, on a local store.
# Per bound, over the saves after the first (steady state), medians of:
#   stall_s    how long the training loop waited for the save (call + snapshot wait)
#   snap_s     save call to snapshot complete (the copy into staging)
#   durable_s  save call to the commit record (persist_s + commit_s of rank 0)
#   peak_mib   staging in use at its peak (whole process)
# and the final digest, which must be the same for every bound. Each store is deleted after
# its row (STEPS / EVERY saves of the whole state each).
# Usage: scripts/bench-staging.sh [PARAMS] [LAYOUT] [BOUNDS...]
#   default: 16M dp=1 unbounded 128M 64M 16M 4M   (4M = one chunk of the default chunk size)
# CKPT_TRAIN picks the binary (default: a release build); BENCH_DIR the working directory.
set -euo pipefail
cd "$(dirname "$0")/.."
PARAMS="${1:-16M}"
LAYOUT="${2:-dp=1}"
shift $(($# > 2 ? 2 : $#))
BOUNDS=("$@")
[ ${#BOUNDS[@]} -gt 0 ] || BOUNDS=(unbounded 128M 64M 16M 4M)
OUT="${BENCH_DIR:-$PWD/bench-out/staging}"
STEPS="${STEPS:-8}"
EVERY="${EVERY:-2}"
if [ -z "${CKPT_TRAIN:-}" ]; then
  cargo build --release -q -p ckpt-train --bin ckpt-train
  CKPT_TRAIN="$PWD/target/release/ckpt-train"
fi
rm -rf "$OUT"
mkdir -p "$OUT"
export CKPT_LOG=${CKPT_LOG:-warn}

echo "machine: $(nproc) cores; binary: $CKPT_TRAIN; commit: $(git rev-parse --short HEAD)"
echo "workload: --params $PARAMS --layout $LAYOUT --steps $STEPS --ckpt-every $EVERY --prefault"
printf '%-10s %6s %9s %9s %10s %9s %8s  %s\n' bound saves stall_s snap_s durable_s peak_mib wall_s digest
for b in "${BOUNDS[@]}"; do
  store="$OUT/store-$b"
  m="$OUT/metrics-$b.jsonl"
  extra=()
  [ "$b" = unbounded ] || extra=(--staging "$b")
  t0=$(date +%s.%N)
  digest=$("$CKPT_TRAIN" --store "$store" --run bench --params "$PARAMS" --layout "$LAYOUT" \
    --steps "$STEPS" --ckpt-every "$EVERY" --prefault --metrics-out "$m" "${extra[@]}" |
    sed -n 's/^digest //p')
  t1=$(date +%s.%N)
  # Rank 0's checkpoint records after the first save.
  jq -rs --arg b "$b" --arg d "$digest" --argjson wall "$(echo "$t1 - $t0" | bc)" '
    def median: sort | if length == 0 then null else .[(length / 2 | floor)] end;
    [.[] | select(.kind == "checkpoint" and .rank == 0)] | sort_by(.step) | .[1:] as $s
    | [$b, ($s | length),
       ($s | map(.stall_s) | median), ($s | map(.snapshot_s) | median),
       ($s | map(.persist_s + .commit_s) | median),
       ($s | map(.staging_peak) | max / 1048576), $wall, $d[0:16]]
    | @tsv' "$m" |
    awk -F'\t' '{ printf "%-10s %6d %9.3f %9.3f %10.3f %9.0f %8.1f  %s\n", $1, $2, $3, $4, $5, $6, $7, $8 }'
  rm -rf "$store" # the figures are in the metrics; the disk is not
done
