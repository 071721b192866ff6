#!/usr/bin/env bash
# `ckpt export` split across processes (issue 17.3): throughput with 1, 2 and 4 processes
# (`--part I/N` started at once, then `--write-index`; and `--jobs N`), peak RSS per process,
# against this machine's limits measured in the same run: O_DIRECT disk write and copy (dd),
# memcpy (numpy, when the test venv has it) and zstd decompression (zstd -b on the data).
# Every split export is checked byte-identical to the one-process export.
# Usage: scripts/bench-export-parts.sh [GIB] [SHARD]   (default 2 GiB, 256MiB shards)
# BENCH_DIR picks the working directory (default bench-out/export-parts, on the repository's
# disk); figures go to stdout and $BENCH_DIR/results.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
GIB="${1:-2}"
SHARD="${2:-256MiB}"
OUT="${BENCH_DIR:-$PWD/bench-out/export-parts}"
rm -rf "$OUT"
mkdir -p "$OUT"
RES="$OUT/results.txt"
: >"$RES"
PY="${CKPT_PYTHON:-/work/main/.ci-tools/venv/bin/python}"

# PROFILE=debug uses the binaries a test build left (no release build; slower figures).
PROFILE="${PROFILE:-release}"
if [ "$PROFILE" = release ]; then
  cargo build --release -q -p ckpt --bin ckpt --example bench_ckpt
fi
BIN="$PWD/target/$PROFILE/ckpt"
EX="$PWD/target/$PROFILE/examples"

log() { echo "$*" | tee -a "$RES"; }
now() { date +%s.%N; }
mibs() { awk -v b="$1" -v s="$2" 'BEGIN { printf "%.0f", b / s / 1048576 }'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", a / b }'; }
# Run a command under /usr/bin/time; prints "wall_s max_rss_kib".
timed() {
  /usr/bin/time -f "%e %M" -o "$OUT/.time" "$@" >"$OUT/.stdout" 2>"$OUT/.stderr" || {
    cat "$OUT/.stderr" >&2
    return 1
  }
  cat "$OUT/.time"
}

log "machine: $(nproc) cores (the figures below are for $(nproc) cores: N processes share them), $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(df -h "$OUT" | awk 'NR==2 {print $1, $2}')"
log "date: $(date -u +%FT%TZ)  commit: $(git rev-parse --short HEAD)  binaries: target/$PROFILE"

# 1. Limits: the disk with O_DIRECT (the export writes with O_DIRECT), memcpy, decompression.
N=$((GIB * 64)) # 16 MiB blocks
DD_BYTES=$((N * 16 * 1048576))
read -r w _ < <(timed dd if=/dev/zero of="$OUT/dd.bin" bs=16M count="$N" oflag=direct conv=fsync)
DISK_W=$(mibs "$DD_BYTES" "$w")
read -r c _ < <(timed dd if="$OUT/dd.bin" of="$OUT/dd2.bin" bs=16M iflag=direct oflag=direct conv=fsync)
DISK_C=$(mibs "$DD_BYTES" "$c")
rm -f "$OUT/dd.bin" "$OUT/dd2.bin"
log "disk: O_DIRECT write $DISK_W MiB/s, copy (read+write) $DISK_C MiB/s  [dd bs=16M, $GIB GiB]"
if "$PY" -c 'import numpy' 2>/dev/null; then
  MEMCPY=$("$PY" -c '
import numpy as np, time
a = np.ones(1 << 30, dtype=np.uint8); b = np.empty_like(a); np.copyto(b, a)
t = time.perf_counter(); n = 4
for _ in range(n): np.copyto(b, a)
print(round(n * a.nbytes / (time.perf_counter() - t) / 2**20))')
  log "memcpy: $MEMCPY MiB/s (numpy copyto, 1 GiB warm, 1 thread)"
else
  MEMCPY=""
  log "memcpy: not measured (no numpy in $PY)"
fi

# 2. The step: GIB GiB of bf16 weights saved by 4 tensor-parallel ranks.
STORE="$OUT/store"
"$EX/bench_ckpt" "$STORE" bench 1 "$GIB" 4 2>&1 | tee -a "$RES"
log "store holds $(du -sb "$STORE" | awk '{printf "%.2f GiB", $1/1073741824}') on disk"

# 3. One process (the reference every split export must equal).
REF="$OUT/p1"
read -r t rss < <(timed "$BIN" --store "$STORE" export bench@1 --out "$REF" --max-shard-size "$SHARD" --no-progress --json)
TOTAL=$(du -sb "$REF" | cut -f1)
FILES=$(ls "$REF"/model-*.safetensors | wc -l)
ONE=$(mibs "$TOTAL" "$t")
BUDGET=$("$PY" -c 'import json,sys; r=json.load(open(sys.argv[1])); print(r["memory_budget"]>>20, r["pipeline"])' "$OUT/.stdout" 2>/dev/null || echo "?")
log "export, 1 process: $t s, $ONE MiB/s ($TOTAL bytes in $FILES files of <= $SHARD), peak RSS $((rss / 1024)) MiB; budget/pipeline: $BUDGET"
log "  vs disk write $(ratio "$ONE" "$DISK_W")x, vs disk copy $(ratio "$ONE" "$DISK_C")x"
log "  cmd: ckpt --store $STORE export bench@1 --out $REF --max-shard-size $SHARD"

# zstd decompression over the data (level 1, as the store's fast codec), in memory.
head -c $((256 << 20)) "$REF/model-00001-of-$(printf %05d "$FILES").safetensors" >"$OUT/sample.bin"
ZD=$(zstd -b1 -i3 "$OUT/sample.bin" 2>&1 | tr '\r' '\n' | grep -E 'MB/s' | tail -1 | awk '{print $(NF-1)}')
rm -f "$OUT/sample.bin"
log "zstd -1 decompression of 256 MiB of the data: $ZD MB/s (zstd -b1, 1 thread)"

# 4. N processes: --part I/N started at once (as on N machines), then --write-index.
for n in 2 4; do
  D="$OUT/parts$n"
  t0=$(now)
  pids=()
  for ((i = 0; i < n; i++)); do
    /usr/bin/time -f "%e %M" -o "$OUT/.time$i" "$BIN" --store "$STORE" export bench@1 --out "$D" \
      --max-shard-size "$SHARD" --part "$i/$n" --no-progress >"$OUT/.part$i" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  "$BIN" --store "$STORE" export bench@1 --out "$D" --max-shard-size "$SHARD" --write-index >/dev/null
  t=$(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }')
  R=$(mibs "$TOTAL" "$t")
  per=""
  for ((i = 0; i < n; i++)); do
    read -r pt prss <"$OUT/.time$i"
    per="$per part $i: ${pt} s, $((prss / 1024)) MiB;"
  done
  for f in "$REF"/*; do cmp -s "$f" "$D/$(basename "$f")" || { echo "$D/$(basename "$f") differs" >&2; exit 1; }; done
  log "export, $n processes (--part I/$n at once + --write-index): $t s, $R MiB/s, $(ratio "$R" "$ONE")x one process, vs disk write $(ratio "$R" "$DISK_W")x; peak RSS per process:$per union byte-identical"
  log "  cmd: for i in 0..$((n - 1)): ckpt --store $STORE export bench@1 --out $D --max-shard-size $SHARD --part \$i/$n & ; wait; ckpt ... --write-index"
  rm -rf "$D"

  D="$OUT/jobs$n"
  read -r t rss < <(timed "$BIN" --store "$STORE" export bench@1 --out "$D" --max-shard-size "$SHARD" --jobs "$n" --no-progress)
  R=$(mibs "$TOTAL" "$t")
  for f in "$REF"/*; do cmp -s "$f" "$D/$(basename "$f")" || { echo "$D/$(basename "$f") differs" >&2; exit 1; }; done
  log "export --jobs $n: $t s, $R MiB/s, $(ratio "$R" "$ONE")x one process (parent's peak RSS $((rss / 1024)) MiB); byte-identical"
  rm -rf "$D"
done

# 5. Memory follows the budget, not the model: one process with a 64 MiB budget (every
# tensor is 64 MiB).
D="$OUT/small"
read -r t rss < <(timed "$BIN" --store "$STORE" export bench@1 --out "$D" --max-shard-size "$SHARD" --memory-budget 64MiB --no-progress)
log "export, 1 process, --memory-budget 64MiB: $t s, $(mibs "$TOTAL" "$t") MiB/s, peak RSS $((rss / 1024)) MiB"
rm -rf "$D"
echo "results in $RES"
