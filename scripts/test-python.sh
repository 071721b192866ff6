#!/usr/bin/env bash
# The Python package's tests: builds python/ (PyO3 + maturin, module ckpt._native) into
# .ci-tools/venv with the workspace's target directory, so no dependency is built twice, then
# runs pytest on python/tests (CPU torch, gloo). Extra arguments go to pytest.
# Needs scripts/install-test-deps.sh (torch, pytest, maturin in .ci-tools/venv); another venv:
# CKPT_PYTHON=/path/to/venv/bin/python (as the Rust tests take it).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${CKPT_PYTHON:-$root/.ci-tools/venv/bin/python}"
venv="$(cd "$(dirname "$python")/.." && pwd)"
export VIRTUAL_ENV="$venv"
export PATH="$venv/bin:$PATH"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}"
cd "$root/python"
# An editable install of the dev profile (the workspace's optimized dev dependencies).
maturin develop --quiet
python -m pytest -q -p no:cacheprovider tests "$@"
