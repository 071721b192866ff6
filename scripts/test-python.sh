#!/usr/bin/env bash
# The Python package's tests: builds python/ (PyO3 + maturin, module ckpt._native) into
# .ci-tools/venv with the workspace's target directory, so no dependency is built twice, then
# runs pytest on python/tests (CPU torch, gloo). Extra arguments go to pytest.
# Needs scripts/install-test-deps.sh (torch, pytest, maturin in .ci-tools/venv).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="$root/.ci-tools/venv"
export VIRTUAL_ENV="$venv"
export PATH="$venv/bin:$PATH"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}"
cd "$root/python"
# An editable install of the dev profile (the workspace's optimized dev dependencies).
maturin develop --quiet
python -m pytest -q -p no:cacheprovider tests "$@"
