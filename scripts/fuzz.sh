#!/usr/bin/env bash
# Every decoder's property test with many cases (issue 13.3): the store's decoders of stored
# bytes (store/tests/hostile.rs), the peer protocol's frames (recovery/tests/peer_frames.rs) and
# the decoders of what people and processes hand the CLI and the
# supervisor (ckpt/tests/fuzz.rs). Each test runs PROPTEST_CASES cases (CI runs a few
# thousand); a failing case (a panic, or a wrong value) fails its test and proptest prints
# the smallest input that fails.
#   scripts/fuzz.sh [CASES] [NEXTEST_FILTER]
# CASES: 100000 by default. NEXTEST_FILTER narrows the selection, e.g. 'test(/import/)'.
set -euo pipefail
cd "$(dirname "$0")/.."
cases="${1:-100000}"
select='(package(ckpt-store) & kind(test) & binary(hostile)) | (package(ckpt-recovery) & kind(test) & binary(peer_frames)) | (package(ckpt) & binary(fuzz))'
if [ -n "${2:-}" ]; then
    select="($select) & (${2})"
fi
log="$(mktemp -t ckpt-fuzz.XXXXXX.log)"
echo "fuzzing with $cases cases per decoder; log: $log"
set +e
PROPTEST_CASES="$cases" cargo nextest run --profile fuzz --no-fail-fast \
    -p ckpt-store -p ckpt-recovery -p ckpt -E "$select" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
# nextest prints one line per test: STATUS [ TIME] (i/n) BINARY TEST.
echo
printf '%-76s %10s %8s %10s\n' "decoder (test)" "cases" "panics" "seconds"
re='^ *(PASS|FAIL|TIMEOUT|SIGSEGV|SIGABRT|SIGKILL|ABORT|LEAK-FAIL) +\[ *([0-9.]+)s\].* ([^ ]+) ([^ ]+)$'
n=0
failed=0
while IFS= read -r line; do
    [[ $line =~ $re ]] || continue
    what="${BASH_REMATCH[3]} ${BASH_REMATCH[4]}"
    if [ "${BASH_REMATCH[1]}" = PASS ]; then
        printf '%-76s %10s %8s %10s\n' "$what" "$cases" 0 "${BASH_REMATCH[2]}"
    else
        printf '%-76s %10s %8s %10s\n' "$what" - "${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}"
        failed=$((failed + 1))
    fi
    n=$((n + 1))
done < <(sed 's/\x1b\[[0-9;]*m//g' "$log")
echo "$n decoder test(s), $failed failed (a failed test's smallest failing input is in the log)"
exit "$status"
