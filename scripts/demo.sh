#!/usr/bin/env bash
# The main job: train on 4 ranks, checkpoint, crash (SIGKILL) midway, recover on a smaller
# layout from the newest committed checkpoint, and check the result is bit-identical to a
# run that never crashed. Everything on the default local store (./demo-store).
set -euo pipefail
cd "$(dirname "$0")/.."
store="${CKPT_DEMO_STORE:-$PWD/demo-store}"
params="${CKPT_DEMO_PARAMS:-20M}"
steps=40
every=10
echo "== building (release)"
cargo build --release -q -p ckpt-trainer --bin ckpt-train
cargo build --release -q -p ckpt --bin ckpt 2>/dev/null || true
train=target/release/ckpt-train
ckpt=target/release/ckpt
rm -rf "$store"
export CKPT_LOG=${CKPT_LOG:-warn}

echo "== 1. reference run: $params parameters, dp=2,tp=2,zero=1, $steps steps, a checkpoint every $every"
ref=$($train --store "$store" --run reference --layout dp=2,tp=2,zero=1 --params "$params" \
  --steps $steps --ckpt-every $every --metrics-out "$store.reference.jsonl" | sed -n 's/^digest //p')
echo "   final state digest: $ref"

echo "== 2. the same job, one process per rank; rank 2 is killed with SIGKILL at step ~25"
pids=()
for r in 0 1 2 3; do
  $train --store "$store" --run demo --layout dp=2,tp=2,zero=1 --params "$params" \
    --steps $steps --ckpt-every $every --rank $r --step-time-ms 100 \
    > "$store.rank$r.out" 2> "$store.rank$r.err" &
  pids+=($!)
done
sleep 2.7
kill -9 "${pids[2]}"
echo "   killed rank 2 (pid ${pids[2]}); stopping the survivors"
sleep 0.5
for p in "${pids[0]}" "${pids[1]}" "${pids[3]}"; do kill -9 "$p" 2>/dev/null || true; done
wait 2>/dev/null || true
if [ -x "$ckpt" ]; then "$ckpt" --store "$store" ls demo || true; fi

echo "== 3. recover on 2 ranks (dp=1,tp=2,zero=3) from the newest committed checkpoint"
got=$($train --store "$store" --run demo --layout dp=1,tp=2,zero=3 --params "$params" \
  --steps $steps --ckpt-every $every --resume | sed -n 's/^digest //p')
echo "   final state digest: $got"
if [ -x "$ckpt" ]; then "$ckpt" --store "$store" verify demo || true; fi

if [ "$got" = "$ref" ]; then
  echo "== OK: the recovered, resharded run ended bit-identical to the uninterrupted one"
else
  echo "== MISMATCH: $got != $ref" >&2
  exit 1
fi
