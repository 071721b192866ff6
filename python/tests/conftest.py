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


def step_left_in_the_tiers(tmp_path: Path, spawn):
    """Two machines with a tier each (below `tmp_path / "tiers"`) and the store `tmp_path /
    "store"`: run `spawn("drained")` (step 1 on the store) and `spawn("killed")` (step 2 in
    both tiers only, the job killed before its drain), check that, then run `spawn("load", 1)`
    with machine 1's node commit of step 2 set aside (no step newer than the store's is on
    every tier) and put it back. Returns the store, run "k"."""
    import ckpt

    tiers = tmp_path / "tiers"
    spawn("drained")
    spawn("killed")
    remote = ckpt.Store(str(tmp_path / "store"))
    assert remote.committed_steps("k") == [1]
    for m in (0, 1):
        assert ckpt.Store(str(tiers / f"machine-{m}")).node_committed_steps("k") == [1, 2]
    # Machine 1's node commit of step 2 (its first rank is 2) set aside.
    commit = tiers / "machine-1" / "runs" / "k" / "steps" / f"{2:020}" / "nodes"
    commit = commit / "rank-000002.commit"
    aside = tmp_path / "commit-aside"
    commit.rename(aside)
    spawn("load", 1)
    assert remote.committed_steps("k") == [1]
    aside.rename(commit)
    return remote
