"""Shared fixtures of the ckpt Python tests (run by scripts/test-python.sh)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def ckpt_bin() -> Path:
    """The `ckpt` CLI of this workspace, built now (cargo builds only what changed), or
    $CKPT_BIN when set."""
    if os.environ.get("CKPT_BIN"):
        return Path(os.environ["CKPT_BIN"])
    subprocess.run(["cargo", "build", "-q", "-p", "ckpt"], cwd=ROOT, check=True)
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    return target / "debug" / "ckpt"


def stored_objects(store: Path) -> set:
    """Every chunk and pack object of a local store."""
    return {
        p.relative_to(store)
        for d in ("chunks", "packs")
        if (store / d).exists()
        for p in (store / d).rglob("*")
        if p.is_file()
    }
