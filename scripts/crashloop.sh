#!/usr/bin/env bash
# The crash loop outside CI: ROUNDS rounds (100 by default) of random SIGKILLs of saves,
# commits, restores and gc on one run; every committed step must verify clean after each
# round, and the run must end bit-identical to an uninterrupted one. SEED replays a schedule.
#   scripts/crashloop.sh [ROUNDS] [SEED]
set -euo pipefail
cd "$(dirname "$0")/.."
export CKPT_CRASHLOOP_ROUNDS="${1:-100}"
[ -n "${2:-}" ] && export CKPT_CRASHLOOP_SEED="$2"
# The test builds (or finds up to date) the ckpt and ckpt-train binaries it runs.
cargo test -q -p ckpt-tests --test crashloop -- --nocapture
