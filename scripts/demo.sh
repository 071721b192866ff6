#!/usr/bin/env bash
# The main job, on the default local store (./demo-store):
#   1. a reference run of the reference workload, never interrupted;
#   2. the same job under `ckpt resume` on 4 simulated nodes (one rank each, dp=2,tp=2,
#      ZeRO-1, a replica agent per node keeping the newest snapshots in memory with a copy on
#      the next node), one rank killed with SIGKILL midway: the supervisor detects it, stops
#      the job (the dead node's agent goes with it), restarts it resharded on the 3 nodes left
#      (dp=1,tp=2) from the newest committed checkpoint, read from the surviving agents'
#      memory where they hold it and from the store otherwise, and the job finishes;
#   3. the final state compared bit for bit with the reference, then `ckpt ls`, `ckpt verify`
#      and `ckpt plot` of what happened.
set -euo pipefail
cd "$(dirname "$0")/.."
store="${CKPT_DEMO_STORE:-$PWD/demo-store}"
params="${CKPT_DEMO_PARAMS:-20M}"
steps=40
every=5
echo "== building (release)"
cargo build --release -q -p ckpt-train --bin ckpt-train
cargo build --release -q -p ckpt --bin ckpt
train="$PWD/target/release/ckpt-train"
ckpt="$PWD/target/release/ckpt"
rm -rf "$store" "$store.logs"
mkdir -p "$store"
export CKPT_LOG=${CKPT_LOG:-warn}

echo "== 1. reference: $params parameters, dp=2,tp=2,zero=1, $steps steps, a checkpoint every $every, never interrupted"
ref=$("$train" --store "$store" --run reference --layout dp=2,tp=2 --zero 1 --params "$params" \
  --steps $steps --ckpt-every $every | sed -n 's/^digest //p')
echo "   final state digest $ref"

echo "== 2. the same job under ckpt resume on 4 nodes with peer replicas; a rank gets SIGKILL midway"
"$ckpt" --store "$store" resume --run demo --nodes 4 --ranks-per-node 1 --layout dp=2,tp=2 --peer-replicas \
  --heartbeat-timeout 3s --stop-grace 2s --backoff 200ms --logs "$store.logs" -- \
  "$train" --zero 1 --params "$params" --steps $steps --ckpt-every $every --step-time-ms 150 \
  > "$store.resume.txt" 2> "$store.resume.err" &
sup=$!
victim=""
for _ in $(seq 1 600); do
  step=$(grep -ho '"step":[0-9]*' "$store.logs"/rank-0.gen-*.out 2>/dev/null | tail -1 || true)
  # Wait until training is well under way (rank 2 of the first generation is alive).
  for p in $(pgrep -f "$train" || true); do
    if tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx 'CKPT_RANK=2' &&
       tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx 'CKPT_RUN=demo'; then
      victim=$p
    fi
  done
  if [ -n "$victim" ] && [ "$("$ckpt" --store "$store" ls demo --json 2>/dev/null | grep -c '"committed": true' || true)" -ge 2 ]; then
    break
  fi
  sleep 0.2
done
if [ -n "$victim" ]; then
  echo "   killing rank 2 (pid $victim) with SIGKILL"
  kill -9 "$victim"
fi
wait $sup || { cat "$store.resume.txt" "$store.resume.err"; echo "== the supervised job failed" >&2; exit 1; }
sed 's/^/   /' "$store.resume.txt"

got=""
for f in $(ls "$store.logs"/rank-0.gen-*.out | sort -t- -k3 -n); do
  d=$(sed -n 's/^digest //p' "$f")
  [ -n "$d" ] && got=$d
done
echo "== 3. final state digest $got"
"$ckpt" --store "$store" ls demo | sed 's/^/   /'
"$ckpt" --store "$store" verify demo | sed 's/^/   /'
"$ckpt" --store "$store" plot demo --out "$store.demo.png" >/dev/null && echo "   plot: $store.demo.png"
if [ "$got" = "$ref" ]; then
  echo "== OK: the recovered, resharded run ended bit-identical to the uninterrupted one"
else
  echo "== MISMATCH: $got != $ref" >&2
  exit 1
fi
