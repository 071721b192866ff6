"""ckpt.CheckpointManager (the Rust manager under a PyTorch loop): sharded round trips onto
other placements and world sizes, the snapshot semantics (a change after `maybe_save` returned
never reaches the checkpoint), restore on an empty store, retention, a final checkpoint on
SIGTERM, and interop with ckpt.dcp.StorageReader and `ckpt export`."""

import os
import signal
import socket
import subprocess
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import ckpt
from ckpt.dcp import StorageReader
from conftest import step_left_in_the_tiers
from _workers import (
    assert_same,
    flat,
    full_state,
    manager_roundtrip,
    manager_ddp_bitflip,
    manager_plain_writers,
    manager_sigterm,
    placeholder,
    plain_sizes,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_shard0_restore_resharded_replicated_and_single_process(tmp_path):
    store = str(tmp_path / "store")
    mp.spawn(manager_roundtrip, args=(2, free_port(), store, "m"), nprocs=2)
    # One process, plain tensors, from the step two ranks saved sharded.
    full = full_state()
    mine = placeholder(full)
    assert ckpt.CheckpointManager(store, run="m").restore_latest(mine) == 1
    assert_same(mine, full, "one process vs the saved state")
    assert mine["extra"]["epoch"] == 3 and mine["extra"]["cfg"]["name"] == "tiny"
    assert ckpt.Store(store).open_step("m").world == 2


def test_a_change_after_maybe_save_returned_never_reaches_the_checkpoint(tmp_path):
    store = str(tmp_path / "store")
    w = torch.randn(4096, 4096)  # 64 MiB: the persist is still running when the loop goes on
    b = torch.randn(4096).to(torch.bfloat16)
    before_w, before_b = w.clone(), b.clone()
    state = {"model": {"w": w, "b": b}, "step": 1}
    mgr = ckpt.CheckpointManager(store, run="mut", every_steps=1)
    assert mgr.maybe_save(1, state)
    # The snapshot is taken, the persist still runs (64 MiB to hash, encode and write).
    assert mgr.last_report()["stage"] == "snapshotted", mgr.last_report()
    # The optimizer step, at once.
    w.add_(1.0)
    b.mul_(2)
    state["step"] = 2
    mgr.finish()
    assert mgr.last_report()["stage"] == "committed"
    got = {"model": {"w": torch.zeros_like(w), "b": torch.zeros_like(b)}, "step": 0}
    assert ckpt.CheckpointManager(store, run="mut").restore_latest(got) == 1
    assert torch.equal(got["model"]["w"], before_w), "a change after the snapshot was saved"
    assert torch.equal(got["model"]["b"], before_b)
    assert got["step"] == 1
    # The next checkpoint has the changed state.
    assert mgr.maybe_save(2, state)
    mgr.finish()
    assert ckpt.CheckpointManager(store, run="mut").restore_latest(got) == 2
    assert torch.equal(got["model"]["w"], w) and torch.equal(got["model"]["b"], b)


def test_restore_latest_on_an_empty_store_is_none_and_touches_nothing(tmp_path):
    mgr = ckpt.CheckpointManager(str(tmp_path / "store"), run="empty", every_steps=10)
    state = {"w": torch.ones(3), "n": 5}
    assert mgr.restore_latest(state) is None
    assert torch.equal(state["w"], torch.ones(3)) and state["n"] == 5
    # Not due: nothing saved. The state is read once to size the staging ahead of the first
    # save; a state that cannot be saved (on meta) fails only a save, and stages nothing.
    assert not mgr.maybe_save(3, {"w": torch.ones(3, device="meta")})
    assert mgr.staging()["allocated"] == 0
    mgr.finish()
    assert ckpt.Store(str(tmp_path / "store")).committed_steps("empty") == []


def test_the_staging_fills_ahead_of_the_first_checkpoint(tmp_path):
    # The first step without a checkpoint sizes the staging pool for the state handed over
    # and fills it in the background, so the first checkpoint copies into memory already
    # faulted in; it takes no more than was filled.
    store = str(tmp_path / "store")
    w = torch.arange(1 << 20, dtype=torch.float32)
    mgr = ckpt.CheckpointManager(store, run="ahead", every_steps=4)
    assert mgr.staging()["allocated"] == 0
    assert not mgr.maybe_save(1, {"w": w, "n": 1})
    deadline = time.monotonic() + 60
    while mgr.staging()["allocated"] < w.nbytes and time.monotonic() < deadline:
        time.sleep(0.01)
    ahead = mgr.staging()
    assert ahead["allocated"] >= w.nbytes and ahead["in_use"] == 0, ahead
    taken = [s for s in range(2, 5) if mgr.maybe_save(s, {"w": w + s, "n": s})]
    assert taken == [4]
    mgr.wait()
    assert mgr.staging()["allocated"] == ahead["allocated"], (mgr.staging(), ahead)
    mgr.finish()
    got = {"w": torch.zeros_like(w), "n": 0}
    assert ckpt.CheckpointManager(store, run="ahead").restore_latest(got) == 4
    assert torch.equal(got["w"], w + 4) and got["n"] == 4
    # A job that only restores (no interval, no final checkpoint) keeps no copy of the state.
    reader = ckpt.CheckpointManager(store, run="ahead", final_on_sigterm=False)
    assert not reader.maybe_save(5, {"w": w, "n": 5})
    time.sleep(0.3)
    assert reader.staging()["allocated"] == 0


def test_the_interval_and_keep_last(tmp_path):
    store = str(tmp_path / "store")
    w = torch.zeros(256, 256)
    mgr = ckpt.CheckpointManager(store, run="keep", every_steps=2, keep_last=2)
    taken = []
    for step in range(1, 13):
        w.fill_(step)
        if mgr.maybe_save(step, {"w": w}):
            taken.append(step)
            # No pause for retention: a sweep asked for while the one before still runs
            # follows it, and finish() waits for both.
            mgr.wait()
    mgr.finish()
    assert taken == [2, 4, 6, 8, 10, 12]
    steps = ckpt.Store(store).committed_steps("keep")
    # Retention runs when a save starts, on the steps committed then: the newest two of them
    # and the step being saved survive.
    assert steps == [8, 10, 12], steps
    got = {"w": torch.zeros(256, 256)}
    assert ckpt.CheckpointManager(store, run="keep").restore_latest(got) == 12
    assert torch.equal(got["w"], torch.full((256, 256), 12.0))


def test_sigterm_to_one_rank_leaves_a_final_checkpoint_of_the_step_it_was_at(tmp_path):
    store, progress = str(tmp_path / "store"), tmp_path / "progress"
    progress.mkdir()
    ctx = mp.start_processes(
        manager_sigterm,
        args=(2, free_port(), store, "term", str(progress)),
        nprocs=2,
        join=False,
        start_method="spawn",
    )
    deadline = time.time() + 120
    while True:
        try:
            if int((progress / "rank-1").read_text() or 0) >= 5:
                break
        except (FileNotFoundError, ValueError):
            pass
        assert time.time() < deadline, "the ranks did not start stepping"
        time.sleep(0.05)
    os.kill(ctx.processes[1].pid, signal.SIGTERM)
    while not ctx.join(timeout=120):
        pass
    finals = {int((progress / f"final-{r}").read_text()) for r in range(2)}
    assert len(finals) == 1, f"the ranks took their final checkpoints at steps {finals}"
    (final,) = finals
    assert final >= 5
    assert ckpt.Store(store).committed_steps("term") == [final]
    got = {"model": {"w": torch.zeros(64, 64)}, "step": 0}
    assert ckpt.CheckpointManager(store, run="term").restore_latest(got) == final
    assert torch.equal(got["model"]["w"], torch.full((64, 64), float(final)))
    assert got["step"] == final


def test_a_step_of_the_manager_loads_through_dcp_and_exports_with_its_names(tmp_path, ckpt_bin):
    from safetensors.torch import load_file

    store, out = tmp_path / "store", tmp_path / "export"
    full = full_state()
    state = {k: full[k] for k in ("model", "optim", "emb")}
    mgr = ckpt.CheckpointManager(str(store), run="x", every_steps=5)
    assert mgr.maybe_save(5, state)
    mgr.finish()
    tensors_only = {
        "model": placeholder(full["model"]),
        "optim": {"state": placeholder(full["optim"]["state"])},
        "emb": placeholder(full["emb"]),
    }
    reader = StorageReader(str(store), run="x")
    dcp.load(tensors_only, storage_reader=reader)
    assert reader.checkpoint_step == 5
    want = {"model": full["model"], "optim": {"state": full["optim"]["state"]}, "emb": full["emb"]}
    assert_same(tensors_only, want, "DCP's load of the manager's step")
    for args in (["verify", "x"], ["export", "x@5", "--out", str(out)]):
        subprocess.run([str(ckpt_bin), *args], env={"CKPT_STORE": str(store)}, check=True)
    got = {}
    for f in out.glob("*.safetensors"):
        got.update(load_file(f))
    want = {k: v for k, v in flat(state) if isinstance(v, torch.Tensor)}
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_bad_state_gets_an_error_naming_the_tensor(tmp_path):
    mgr = ckpt.CheckpointManager(str(tmp_path / "store"), run="bad", every_steps=1)
    with pytest.raises(ckpt.CkptError, match="tensor 'model.w' is on meta"):
        mgr.maybe_save(1, {"model": {"w": torch.ones(3, device="meta")}})
    with pytest.raises(ckpt.CkptError, match="tensor 'model.c'.*complex"):
        mgr.maybe_save(2, {"model": {"c": torch.ones(3, dtype=torch.complex64)}})
    # A tensor the step does not have: the restore names it.
    assert mgr.maybe_save(3, {"model": {"w": torch.ones(3)}})
    mgr.finish()
    with pytest.raises(ckpt.CkptError, match='no tensor "model.v"'):
        ckpt.CheckpointManager(str(tmp_path / "store"), run="bad").restore_latest(
            {"model": {"v": torch.ones(3)}}
        )


def _events(store, run, kind):
    """The records of `kind` in a local store's events log of `run`."""
    import json
    from pathlib import Path

    out = []
    for f in sorted((Path(store) / "runs" / run / "events").glob("*.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            if r.get("kind") == kind:
                out.append(r)
    return out


def test_ddp_replicas_compared_by_hash_a_flipped_bit_names_the_rank(tmp_path, ckpt_bin):
    # The sentinel through DDP: three ranks hold the same parameters; rank 1's copy of the
    # first layer's weight gets a flipped bit after step 3; the checkpoint of step 4 finds it.
    store = str(tmp_path / "store")
    mp.spawn(
        manager_ddp_bitflip, args=(3, free_port(), store, "ddp", 1, 3), nprocs=3
    )
    got = subprocess.run(
        [str(ckpt_bin), "--json", "inspect", "ddp@2"],
        env={"CKPT_STORE": store}, capture_output=True, text=True, check=True,
    )
    import json

    before = json.loads(got.stdout)["replicas"]
    assert before["mismatched_chunks"] == 0 and before["chunks_compared"] > 0, before
    got = subprocess.run(
        [str(ckpt_bin), "--json", "inspect", "ddp@4"],
        env={"CKPT_STORE": store}, capture_output=True, text=True, check=True,
    )
    rep = json.loads(got.stdout)["replicas"]
    assert rep["mismatched_chunks"] >= 1, rep
    m = rep["mismatches"][0]
    assert m["suspects"] == [1], m
    assert m["tensor"].startswith("model.0.weight") or m["tensor"].startswith("optim"), m
    events = _events(store, "ddp", "replica_mismatch")
    assert events and events[0]["step"] == 4 and events[0]["suspects"] == [1], events


def test_a_stale_optimizer_state_handed_over_is_reported_at_the_second_checkpoint(tmp_path):
    # The test double of NeMo-RL issue 3312: the loop trains, but the state dict it hands
    # the manager holds a copy of the optimizer state taken once.
    import copy

    store = str(tmp_path / "store")
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    mgr = ckpt.CheckpointManager(store, run="stale", every_steps=5, trainable=model)
    stale = None
    for step in range(1, 16):
        loss = model(torch.randn(8, 256)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if stale is None:
            stale = copy.deepcopy(opt.state_dict())
        mgr.maybe_save(step, {"model": model.state_dict(), "optim": stale})
        mgr.wait()
        found = _events(store, "stale", "state_unchanged")
        if step < 11:
            # The sentinel looks at a save once the next call comes: step 10's at step 11.
            assert not found, (step, found)
    mgr.finish()
    found = _events(store, "stale", "state_unchanged")
    assert len(found) == 1, found
    u = found[0]
    assert u["step"] == 10 and u["steps"] == [5, 10], u
    assert all(t.startswith("optim.state.") for t in u["tensors"]), u
    assert "model.weight" not in u["tensors"] and not u["all"], u


def test_a_local_tier_commits_locally_drains_to_the_store_and_either_tier_restores(tmp_path):
    # Two ranks save Shard(0) into a local tier under the store; rank 0 drains the step; each
    # tier on its own then restores it bit for bit.
    store, local = str(tmp_path / "remote"), str(tmp_path / "local")
    mp.spawn(manager_roundtrip, args=(2, free_port(), store, "t", local), nprocs=2)
    full = full_state()
    assert ckpt.Store(store).committed_steps("t") == [1]
    assert ckpt.Store(local).committed_steps("t") == [1]
    # The store alone (the machine and its tier lost).
    mine = placeholder(full)
    assert ckpt.CheckpointManager(store, run="t").restore_latest(mine) == 1
    assert_same(mine, full, "the drained step read from the store alone")




def test_a_restarted_job_restores_the_step_every_machine_committed_and_none_drained(tmp_path):
    """Two machines of two ranks, a tier each: step 1 on the store, step 2 saved while the store
    was down and the job killed before draining it. A new job's restore_latest drains step 2
    (each machine its ranks) and restores it, not step 1; with one machine lacking it, step 1."""
    from _workers import manager_machine_tiers_left

    store, tiers = str(tmp_path / "store"), str(tmp_path / "tiers")

    def run(phase, want=0):
        mp.spawn(
            manager_machine_tiers_left,
            args=(4, free_port(), store, tiers, "k", phase, want),
            nprocs=4,
        )

    remote = step_left_in_the_tiers(tmp_path, run)
    run("load", 2)
    assert remote.committed_steps("k") == [1, 2]


@pytest.mark.parametrize("how", [True, "detected"])
def test_machines_with_their_own_tiers_commit_their_ranks_there_and_the_last_drain_commits(
    tmp_path, how
):
    # Each rank as a machine of its own (`node_ranks`, or told apart by the machine each rank
    # says it runs on), with its own tier: each commits its rank there and drains it; the step
    # commits on the store once both drained, and restores resharded from there bit for bit
    # (each rank's tier serving its chunks).
    store, local = str(tmp_path / "remote"), str(tmp_path / "local")
    mp.spawn(manager_roundtrip, args=(2, free_port(), store, "n", local, how), nprocs=2)
    assert ckpt.Store(store).committed_steps("n") == [1]
    for r in range(2):
        tier = tmp_path / "local" / f"node-{r}"
        # No tier commits the step: each holds a node commit of its rank.
        assert ckpt.Store(str(tier)).committed_steps("n") == []
        assert len(list(tier.glob("runs/n/steps/*/nodes/rank-*.commit"))) == 1, list(tier.rglob("*"))
    full = full_state()
    mine = placeholder(full)
    assert ckpt.CheckpointManager(store, run="n").restore_latest(mine) == 1
    assert_same(mine, full, "the step two machines drained, read from the store alone")
    # A rank not in its own node's list is refused.
    with pytest.raises(ckpt.CkptError, match="node_ranks"):
        ckpt.CheckpointManager(store, run="n", local_tier=local, rank=1, world=2, node_ranks=[0])
    # Nor is a machine's list without its tier (its ranks would commit nowhere that drains).
    with pytest.raises(ckpt.CkptError, match="no local tier is set"):
        ckpt.CheckpointManager(store, run="n", rank=1, world=2, node_ranks=[0, 1])

def test_a_local_tier_keeps_its_newest_steps_and_a_lost_tier_restores_from_the_store(tmp_path):
    import shutil

    store, local = str(tmp_path / "remote"), str(tmp_path / "local")
    w = torch.zeros(512, 512)
    mgr = ckpt.CheckpointManager(
        store, run="lt", every_steps=1, local_tier=local, keep_local=2
    )
    for step in range(1, 6):
        w.fill_(step)
        assert mgr.maybe_save(step, {"w": w, "step": step})
        mgr.wait()
    mgr.finish()  # returns once the newest step is in the store
    remote = ckpt.Store(store).committed_steps("lt")
    assert remote[-1] == 5, remote
    local_steps = ckpt.Store(local).committed_steps("lt")
    assert local_steps == [4, 5], local_steps
    drains = mgr.drains()
    assert drains and drains[-1]["step"] == 5, drains
    assert sum(d["bytes_sent"] for d in drains) > 0, drains
    assert {d["step"] for d in drains} | {s for d in drains for s in d["skipped"]} >= {5}
    # The local tier first: the newest step, bit for bit.
    got = {"w": torch.zeros(512, 512), "step": 0}
    again = ckpt.CheckpointManager(store, run="lt", local_tier=local)
    assert again.restore_latest(got) == 5
    assert torch.equal(got["w"], torch.full((512, 512), 5.0)) and got["step"] == 5
    # The tier lost with its machine: a new (empty) tier at the same place restores the
    # store's newest step.
    shutil.rmtree(local)
    got = {"w": torch.zeros(512, 512), "step": 0}
    assert ckpt.CheckpointManager(store, run="lt", local_tier=local).restore_latest(got) == 5
    assert torch.equal(got["w"], torch.full((512, 512), 5.0)) and got["step"] == 5
    with pytest.raises(ckpt.CkptError, match="keep_local"):
        ckpt.CheckpointManager(store, run="lt", local_tier=local, keep_local=0)


@pytest.mark.parametrize("how", ["plain", "replicate"])
def test_tensors_every_rank_holds_are_written_with_the_bytes_balanced(tmp_path, how):
    # Two ranks hold the same ten tensors (1-5 MiB), plain (DDP) or DTensors `Replicate()`:
    # each is written by one of them, the largest first to the rank that writes less so far.
    # Spread by a hash of the names (as before), rank 0 wrote 26 MiB and rank 1 5 MiB of these.
    import json
    import zlib

    from ckpt.manager import _balanced_writers

    sizes = plain_sizes()
    by_hash = [0, 0]
    for k, n in sizes.items():
        by_hash[zlib.crc32(k.encode()) % 2] += n
    largest = max(sizes.values())
    assert max(by_hash) - min(by_hash) > largest, by_hash
    store, out = str(tmp_path / "store"), tmp_path / "out"
    out.mkdir()
    mp.spawn(manager_plain_writers, args=(2, free_port(), store, "w", str(out), how), nprocs=2)
    written = [json.loads((out / f"rank-{r}.json").read_text())["bytes_written"] for r in (0, 1)]
    # Chunk headers and the manifest come on top of the tensors' bytes.
    assert sum(written) >= sum(sizes.values()), written
    assert max(written) - min(written) <= largest + (256 << 10), (written, largest)
    # The same writers whatever order the tensors come in, and within the largest of each other.
    items = list(sizes.items())
    w = _balanced_writers(items, 3)
    assert w == _balanced_writers(items[::-1], 3)
    loads = [sum(n for k, n in items if w[k] == r) for r in range(3)]
    assert max(loads) - min(loads) <= largest, loads
