#!/usr/bin/env bash
# The GPU check of ckpt-trainer's feature `cuda`: the CUDA tests (which must not skip) and the
# benchmark (docs/bench/gpu.md), on a machine with an NVIDIA GPU and driver. No CUDA toolkit is
# needed: cudarc loads libcuda (and libnccl, if present) at run time.
#
#   scripts/gpu-check.sh          build (needs cargo) and run; the usual way on a GPU box
#   scripts/gpu-check.sh build    only build the two binaries into target/gpu-check/ (no GPU
#                                 needed): for a GPU machine without a Rust toolchain
#   scripts/gpu-check.sh run      only run target/gpu-check/* (carry that folder there)
#
# Everything printed also goes to $GPU_CHECK_LOG (default: $OUT/gpu-check.log when $OUT is set,
# else target/gpu-check/gpu-check.log). Each phase has its own time limit (tests 150 s, NCCL
# tests 60 s, benchmark 240 s: at most 7.5 minutes; the build 900 s); on an H200 machine with
# 16 cores the run should take two to three minutes.
# Exit status: 0 when the tests pass and the benchmark completes, else non-zero.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-all}
BIN=target/gpu-check
LOG=${GPU_CHECK_LOG:-${OUT:-$BIN}/gpu-check.log}
mkdir -p "$(dirname "$LOG")"
exec > >(tee "$LOG") 2>&1

say() { printf '\n== %s (%s)\n' "$*" "$(date -u +%H:%M:%S)"; }

build() {
  say "build: cargo build --release -p ckpt-trainer --features cuda"
  timeout 900 cargo build --release -p ckpt-trainer --features cuda --example gpu_bench || return 1
  local tests
  tests=$(timeout 900 cargo test --release -p ckpt-trainer --features cuda --test cuda --no-run \
    --message-format=json | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "cuda":
        print(m["executable"])
') || return 1
  [ -n "$tests" ] || { echo "no test binary found"; return 1; }
  mkdir -p "$BIN"
  # Stripped (about 13 MB each instead of 90) so that they can travel to another machine.
  put() { if command -v strip >/dev/null; then strip -o "$2" "$1"; else cp "$1" "$2"; fi; }
  put "$tests" "$BIN/cuda-tests" && put target/release/examples/gpu_bench "$BIN/gpu_bench" || return 1
  ls -l "$BIN"
}

find_nccl() {
  # cudarc opens libnccl.so; packages often ship only libnccl.so.2 (a pip wheel, a runtime
  # package). Expose it under that name.
  ldconfig -p 2>/dev/null | grep -q 'libnccl\.so ' && return 0
  local lib
  lib=$(ldconfig -p 2>/dev/null | awk '/libnccl\.so\.2/ {print $NF; exit}')
  if [ -z "$lib" ]; then
    local roots="/usr/lib /usr/local /opt"
    roots="$roots $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null)"
    # shellcheck disable=SC2086
    lib=$(find $roots -name 'libnccl.so.2*' -type f 2>/dev/null | head -1)
  fi
  [ -n "$lib" ] || { echo "NCCL: not found (the NCCL tests will skip)"; return 1; }
  mkdir -p /tmp/ckpt-nccl && ln -sf "$lib" /tmp/ckpt-nccl/libnccl.so
  export LD_LIBRARY_PATH="/tmp/ckpt-nccl:${LD_LIBRARY_PATH:-}"
  echo "NCCL: $lib"
}

run() {
  [ -x "$BIN/cuda-tests" ] && [ -x "$BIN/gpu_bench" ] || { echo "no binaries in $BIN: run '$0 build' first"; return 1; }
  say "machine"
  uname -a
  nvidia-smi || echo "nvidia-smi failed"
  for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu; do
    [ -e "$d/libcuda.so.1" ] && export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
  done
  local nccl_env=()
  if find_nccl; then nccl_env=(CKPT_REQUIRE_NCCL=1); fi

  say "tests: CUDA tests but NCCL's, none may skip (limit 150 s)"
  env CKPT_REQUIRE_GPU=1 RUST_BACKTRACE=1 \
    timeout 150 "$BIN/cuda-tests" --test-threads=1 --nocapture --skip nccl_
  local tests_rc=$?
  echo "tests exit status: $tests_rc"

  # Apart, so that a communicator that cannot start (no usable network interface, say) costs
  # only its own tests.
  say "tests: NCCL (limit 60 s)"
  env CKPT_REQUIRE_GPU=1 "${nccl_env[@]}" NCCL_DEBUG=WARN RUST_BACKTRACE=1 \
    timeout 60 "$BIN/cuda-tests" --test-threads=1 --nocapture nccl_
  local nccl_rc=$?
  echo "NCCL tests exit status: $nccl_rc"

  say "benchmark (limit 240 s)"
  timeout 240 "$BIN/gpu_bench"
  local bench_rc=$?
  echo "benchmark exit status: $bench_rc"

  say "summary"
  echo "tests: $([ $tests_rc = 0 ] && echo passed || echo "FAILED ($tests_rc)")"
  echo "NCCL tests: $([ $nccl_rc = 0 ] && echo passed || echo "FAILED ($nccl_rc)")"
  grep -h '"metric":"\(snapshot_summary\|stall_summary\|restore\|d2h_memcpy_pinned\|h2d_memcpy_pinned\)"' "$LOG" || true
  echo "log: $LOG"
  [ $tests_rc = 0 ] && [ $nccl_rc = 0 ] && [ $bench_rc = 0 ]
}

case "$mode" in
  build) build ;;
  run) run ;;
  all) build && run ;;
  *) echo "usage: $0 [build|run]"; exit 2 ;;
esac
