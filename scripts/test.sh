#!/usr/bin/env bash
# The test command: installs what the tests need, then runs every test of the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-test-deps.sh
export PATH="$PWD/.ci-tools/bin:$PATH"
export CKPT_PYTHON="$PWD/.ci-tools/venv/bin/python"
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --no-fail-fast "$@"
else
  cargo test --workspace --no-fail-fast "$@"
fi
cargo test --workspace --doc
