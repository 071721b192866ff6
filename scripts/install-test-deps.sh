#!/usr/bin/env bash
# Installs everything the tests need on a fresh machine (idempotent; run as root for apt):
#   - Debian: fuse3 (fusermount3 for auto-unmount), etcd-server/etcd-client (recovery tests),
#     protobuf-compiler and libprotobuf-dev (etcd-client's build script), python3-venv
#   - s3s-fs 0.14.1, a real S3-compatible server that checks signatures (newer releases need a
#     newer rustc than this machine's), into .ci-tools/bin
#   - Python's reference safetensors and numpy, into .ci-tools/venv (interop tests)
#   - PyTorch (CPU), pytest and maturin, into .ci-tools/venv (the Python package's tests,
#     scripts/test-python.sh): torch from PyTorch's CPU index, else from PyPI
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
tools="$root/.ci-tools"
mkdir -p "$tools"

need=()
command -v fusermount3 >/dev/null 2>&1 || need+=(fuse3)
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
command -v etcdctl >/dev/null 2>&1 || need+=(etcd-client)
command -v protoc >/dev/null 2>&1 || need+=(protobuf-compiler)
# etcd-client's build script also needs the well-known .proto files.
[ -f /usr/include/google/protobuf/descriptor.proto ] || need+=(libprotobuf-dev)
python3 -c 'import ensurepip' >/dev/null 2>&1 || need+=(python3-venv)
if ((${#need[@]})); then
  echo "installing Debian packages: ${need[*]}"
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

if [ ! -x "$tools/bin/s3s-fs" ]; then
  echo "installing s3s-fs 0.14.1 (about 3 minutes on 2 cores)"
  cargo install s3s-fs@0.14.1 --features binary --locked --root "$tools" --quiet
fi

if [ ! -x "$tools/venv/bin/python" ]; then
  python3 -m venv "$tools/venv"
fi
if ! "$tools/venv/bin/python" -c 'import safetensors, numpy' >/dev/null 2>&1; then
  echo "installing Python safetensors and numpy"
  "$tools/venv/bin/pip" install -q --disable-pip-version-check safetensors numpy
fi
if ! "$tools/venv/bin/python" -c 'import pytest, maturin' >/dev/null 2>&1; then
  echo "installing Python pytest and maturin"
  "$tools/venv/bin/pip" install -q --disable-pip-version-check pytest 'maturin>=1.5,<2'
fi
if ! "$tools/venv/bin/python" -c 'import torch' >/dev/null 2>&1; then
  echo "installing PyTorch (CPU index first, else PyPI)"
  "$tools/venv/bin/pip" install -q --disable-pip-version-check --retries 1 --timeout 20 torch \
      --index-url https://download.pytorch.org/whl/cpu ||
    "$tools/venv/bin/pip" install -q --disable-pip-version-check torch
fi
