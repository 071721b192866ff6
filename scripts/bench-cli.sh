#!/usr/bin/env bash
# Benchmarks of the ckpt CLI against this machine's limits, measured in the same run:
#   - export of a 2 GiB checkpoint saved by 4 ranks vs the disk's O_DIRECT read and write rates
#   - import of the exported 2 GiB safetensors file vs copying the file
#   - verify of the checkpoint vs raw blake3 over the same bytes
# Usage: scripts/bench-cli.sh [GIB]   (default 2; figures go to stdout and $OUT/results.txt)
# BENCH_DIR picks the working directory (default bench-out/cli, on the repository's disk).
set -euo pipefail
cd "$(dirname "$0")/.."
GIB="${1:-2}"
OUT="${BENCH_DIR:-$PWD/bench-out/cli}"
rm -rf "$OUT"
mkdir -p "$OUT"
RES="$OUT/results.txt"
: >"$RES"

cargo build --release -q -p ckpt --bin ckpt --example bench_ckpt --example b3
BIN="$PWD/target/release/ckpt"
EX="$PWD/target/release/examples"

log() { echo "$*" | tee -a "$RES"; }
# Run a command under /usr/bin/time; prints "wall_s max_rss_kib".
timed() {
  /usr/bin/time -f "%e %M" -o "$OUT/.time" "$@" >"$OUT/.stdout" 2>"$OUT/.stderr" || {
    cat "$OUT/.stderr" >&2
    return 1
  }
  cat "$OUT/.time"
}
mibs() { awk -v b="$1" -v s="$2" 'BEGIN { printf "%.0f", b / s / 1048576 }'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", a / b }'; }

log "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(df -h "$OUT" | awk 'NR==2 {print $1, $2}')"
log "date: $(date -u +%FT%TZ)  commit: $(git rev-parse --short HEAD)"

# 1. Disk limits with O_DIRECT (the store reads and writes large objects with O_DIRECT).
N=$((GIB * 64)) # 16 MiB blocks
DD_BYTES=$((N * 16 * 1048576))
read -r w _ < <(timed dd if=/dev/zero of="$OUT/dd.bin" bs=16M count="$N" oflag=direct conv=fsync)
DISK_W=$(mibs "$DD_BYTES" "$w")
read -r r _ < <(timed dd if="$OUT/dd.bin" of=/dev/null bs=16M iflag=direct)
DISK_R=$(mibs "$DD_BYTES" "$r")
read -r c _ < <(timed dd if="$OUT/dd.bin" of="$OUT/dd2.bin" bs=16M iflag=direct oflag=direct conv=fsync)
DISK_C=$(mibs "$DD_BYTES" "$c")
rm -f "$OUT/dd2.bin"
log "disk: O_DIRECT write $DISK_W MiB/s, read $DISK_R MiB/s, copy (read+write) $DISK_C MiB/s  [dd bs=16M, $GIB GiB]"

# 2. The checkpoint: GIB GiB of bf16 weights, 4 tensor-parallel ranks.
STORE="$OUT/store"
"$EX/bench_ckpt" "$STORE" bench 1 "$GIB" 4 2>&1 | tee -a "$RES"
STORED=$(du -sb "$STORE" | cut -f1)
log "store holds $(awk -v b="$STORED" 'BEGIN {printf "%.2f GiB", b/1073741824}') on disk"

# 3. export vs the disk.
read -r t rss < <(timed "$BIN" --store "$STORE" export bench@1 --out "$OUT/export" --no-progress)
FILE="$OUT/export/model.safetensors"
FB=$(stat -c %s "$FILE")
EXP=$(mibs "$FB" "$t")
log "export: $t s, $EXP MiB/s of file, max RSS $((rss / 1024)) MiB; vs disk write $(ratio "$EXP" "$DISK_W")x, vs disk copy $(ratio "$EXP" "$DISK_C")x"
log "  cmd: ckpt --store $STORE export bench@1 --out $OUT/export"

# 4. import of that file (fresh store: nothing to deduplicate) vs copying it.
read -r t rss < <(timed "$BIN" --store "$OUT/store2" import "$FILE" --run imp --step 1 --no-progress)
IMP=$(mibs "$FB" "$t")
read -r tc _ < <(timed sh -c 'cp "$1" "$2" && sync "$2"' _ "$FILE" "$OUT/copy.safetensors")
CP=$(mibs "$FB" "$tc")
rm -f "$OUT/copy.safetensors"
log "import: $t s, $IMP MiB/s, max RSS $((rss / 1024)) MiB; cp+sync $CP MiB/s; import/cp $(ratio "$IMP" "$CP")x, vs disk copy $(ratio "$IMP" "$DISK_C")x"
log "  cmd: ckpt --store $OUT/store2 import $FILE --run imp --step 1"
# Importing the same file again: every chunk is already stored.
read -r t _ < <(timed "$BIN" --store "$OUT/store2" import "$FILE" --run imp --step 2 --no-progress)
log "import again (all chunks known): $t s, $(mibs "$FB" "$t") MiB/s"

# 5. verify vs raw blake3 over the same bytes.
read -r t rss < <(timed "$BIN" --store "$STORE" verify bench@1 --json)
VB=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["bytes"])' "$OUT/.stdout")
VER=$(mibs "$VB" "$t")
B3_1=$("$EX/b3" "$FILE" 1 | sed -E 's/.* = ([0-9]+) MiB\/s.*/\1/')
B3_N=$("$EX/b3" "$FILE" "$(nproc)" | sed -E 's/.* = ([0-9]+) MiB\/s.*/\1/')
log "verify: $t s for $VB bytes, $VER MiB/s, max RSS $((rss / 1024)) MiB; raw blake3 in memory: 1 thread $B3_1 MiB/s, $(nproc) threads $B3_N MiB/s; verify/blake3($(nproc)) $(ratio "$VER" "$B3_N")x, verify/disk read $(ratio "$VER" "$DISK_R")x"
log "  cmd: ckpt --store $STORE verify bench@1; target/release/examples/b3 $FILE $(nproc)"

rm -f "$OUT/dd.bin"
echo "results in $RES"
