#!/usr/bin/env bash
# The test command: installs what the tests need, then runs every test of the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-test-deps.sh
export PATH="$PWD/.ci-tools/bin:$PATH"
export CKPT_PYTHON="$PWD/.ci-tools/venv/bin/python"
# Everything a test needs is installed above: a test that would skip for a missing
# dependency fails instead.
export CKPT_TEST_REQUIRE_ALL=1
# Some sixty test binaries: on a fresh machine incremental caches only double the target
# folder (17 GiB with them, enough to fill a small disk). A developer's setting wins.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
# The recovery tests across machines need the etcd client (feature etcd, built with protoc).
features="ckpt/etcd,ckpt-tests/etcd"
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --features "$features" --no-fail-fast "$@"
else
  cargo test --workspace --features "$features" --no-fail-fast "$@"
fi
cargo test --workspace --features "$features" --doc
# The Python package (PyTorch's distributed checkpoint backend): pytest on CPU torch.
scripts/test-python.sh
