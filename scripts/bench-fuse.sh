#!/usr/bin/env bash
# Benchmarks of the FUSE mount (docs/bench/fuse.md), all in one run so ratios compare like
# with like on a shared, noisy machine:
#   1. sequential read of a ~2 GiB model.safetensors through the mount (cold: fresh mount,
#      empty chunk cache, page cache dropped; warm: again, from the page cache), against
#      reading the same bytes through SafetensorsView as `ckpt export` does (16 MiB blocks,
#      8 in flight, into memory), `ckpt export` itself (to a file), and the disk's O_DIRECT
#      read rate of a file of the same size;
#   2. latency of random 4 KiB reads: cold (fresh mount), warm in the chunk cache (O_DIRECT,
#      so every read goes through FUSE), warm in the page cache;
#   3. `ls -R` of a step with 10,000 tensors (fresh mount, then again).
# Needs root (mount, drop_caches). Usage: scripts/bench-fuse.sh [GIB]   (default 2)
# Env: BENCH_DIR (default /tmp/ckpt-fuse-bench), CACHE (chunk cache bytes, default 1 GiB).
set -euo pipefail
cd "$(dirname "$0")/.."
gib="${1:-2}"
work="${BENCH_DIR:-/tmp/ckpt-fuse-bench}"
cache="${CACHE:-1073741824}"

cargo build --release -q -p ckpt-fuse --example fuse_bench
bench="$PWD/target/release/examples/fuse_bench"
ckpt=""
if cargo build --release -q -p ckpt 2>/dev/null; then
  ckpt="$PWD/target/release/ckpt"
fi

mnt="$work/mnt"
cleanup() {
  if grep -q " $mnt " /proc/self/mountinfo 2>/dev/null; then umount -l "$mnt" || true; fi
}
trap cleanup EXIT
cleanup
rm -rf "$work"
mkdir -p "$mnt"

now() { date +%s.%N; }
secs() { echo "$2 - $1" | bc -l; }
rate() { echo "scale=3; $1 / $2 / 1000000000" | bc -l; } # bytes, seconds -> GB/s
drop_caches() { sync; echo 3 >/proc/sys/vm/drop_caches; }

mount_fresh() {
  "$bench" mount "$work/store" "$mnt" "$cache" 2>"$work/mount.log" &
  for _ in $(seq 200); do
    grep -q " $mnt " /proc/self/mountinfo && return 0
    sleep 0.05
  done
  echo "mount did not appear:" >&2
  cat "$work/mount.log" >&2
  exit 1
}
unmount() {
  umount "$mnt"
  wait
}

echo "== making the checkpoints ($gib GiB of bf16 weights over tp=2; 10,000 small tensors)"
"$bench" make "$work/store" bench 1 "$gib"
"$bench" many "$work/store" many 1 10000
du -sh "$work/store"

model="$mnt/bench/1/model.safetensors"
declare -A R

echo "== disk: O_DIRECT read of a file of the same size"
size_mib=$(echo "$gib * 1024 / 1" | bc)
dd if=/dev/urandom of="$work/disk.bin" bs=1M count="$size_mib" status=none
sync
t0=$(now)
dd if="$work/disk.bin" of=/dev/null bs=16M iflag=direct status=none
t1=$(now)
R[disk]=$(rate $((size_mib << 20)) "$(secs "$t0" "$t1")")
rm -f "$work/disk.bin"

echo "== SafetensorsView (what export reads), into memory"
drop_caches
read -r bytes s gbs < <("$bench" view "$work/store" bench 1)
R[view]=$gbs
R[bytes]=$bytes

if [ -n "$ckpt" ]; then
  echo "== ckpt export to a file"
  drop_caches
  t0=$(now)
  "$ckpt" --store "$work/store" --no-progress export bench@1 --out "$work/export" >/dev/null
  t1=$(now)
  R[export]=$(rate "$bytes" "$(secs "$t0" "$t1")")
else
  R[export]="n/a (ckpt did not build)"
fi

echo "== mount: sequential dd bs=1M, cold then warm"
drop_caches
mount_fresh
t0=$(now)
dd if="$model" of=/dev/null bs=1M status=none
t1=$(now)
R[mount_cold]=$(rate "$bytes" "$(secs "$t0" "$t1")")
t0=$(now)
dd if="$model" of=/dev/null bs=1M status=none
t1=$(now)
R[mount_warm]=$(rate "$bytes" "$(secs "$t0" "$t1")")
if [ -n "$ckpt" ] && [ -f "$work/export/model.safetensors" ]; then
  cmp "$model" "$work/export/model.safetensors" && R[cmp]="identical" || R[cmp]="DIFFERENT"
  rm -rf "$work/export"
fi
unmount

echo "== mount: random 4 KiB reads"
drop_caches
mount_fresh
read -r c50 c90 c99 cmean < <("$bench" rand "$model" 100 4096 1 direct)
read -r w50 w90 w99 wmean < <("$bench" rand "$model" 100 4096 1 direct)
"$bench" rand "$model" 100 4096 1 >/dev/null
read -r p50 p90 p99 pmean < <("$bench" rand "$model" 100 4096 1)
unmount

echo "== mount: ls -R of 10,000 tensors"
drop_caches
mount_fresh
t0=$(now)
n=$(ls -R "$mnt/many/1" | wc -l)
t1=$(now)
ls_cold=$(secs "$t0" "$t1")
t0=$(now)
ls -R "$mnt/many/1" >/dev/null
t1=$(now)
ls_warm=$(secs "$t0" "$t1")
t0=$(now)
ls -lR "$mnt/many/1" >/dev/null
t1=$(now)
lsl_warm=$(secs "$t0" "$t1")
unmount

ratio() { echo "scale=2; $1 / $2" | bc -l; }
cat <<EOF

## Results ($(date -u +%Y-%m-%dT%H:%MZ), $(nproc) cores, $gib GiB, chunk cache $((cache >> 20)) MiB)

| sequential read of model.safetensors (${R[bytes]} bytes) | GB/s | vs export's read |
|---|---|---|
| disk, dd iflag=direct bs=16M (the read limit) | ${R[disk]} | $(ratio "${R[disk]}" "${R[view]}") |
| SafetensorsView as export reads it, into memory | ${R[view]} | 1.00 |
| ckpt export to a file | ${R[export]} | |
| mount, dd bs=1M, cold | ${R[mount_cold]} | $(ratio "${R[mount_cold]}" "${R[view]}") |
| mount, dd bs=1M, warm (page cache) | ${R[mount_warm]} | $(ratio "${R[mount_warm]}" "${R[view]}") |

mounted file vs exported file: ${R[cmp]:-not compared}

| random 4 KiB reads (100 at the same offsets, µs) | p50 | p90 | p99 | mean |
|---|---|---|---|---|
| cold (fresh mount, O_DIRECT) | $c50 | $c90 | $c99 | $cmean |
| warm chunk cache (O_DIRECT) | $w50 | $w90 | $w99 | $wmean |
| warm page cache (buffered) | $p50 | $p90 | $p99 | $pmean |

| ls of a step with 10,000 tensors ($n lines) | seconds |
|---|---|
| ls -R, fresh mount | $ls_cold |
| ls -R, again | $ls_warm |
| ls -lR, again | $lsl_warm |
EOF
