"""ckpt.dcp as PyTorch's distributed checkpoint storage: round trips resharded against DCP's own
FileSystemWriter/Reader, async_save, damage, dedup, export interop, the newest committed step."""

import dataclasses
import io
import json
import os
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import ckpt
from ckpt.dcp import StorageReader, StorageWriter
from conftest import step_left_in_the_tiers, stored_objects
from _workers import assert_same, distribute, flat, full_state, placeholder, roundtrip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def small_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(64, 32, generator=g),
            "b": torch.randn(32, generator=g).to(torch.bfloat16),
        },
        "step": 7,
    }


def test_two_ranks_shard0_load_resharded_replicated_and_single_process(tmp_path):
    store, fsdir = tmp_path / "store", tmp_path / "fs"
    mp.spawn(roundtrip, args=(2, free_port(), str(store), str(fsdir), "dcp"), nprocs=2)
    # (c) One process, plain tensors, against FileSystemReader and the state saved.
    full = full_state()
    mine, ref = placeholder(full), placeholder(full)
    dcp.load(mine, storage_reader=StorageReader(str(store), run="dcp", step=1))
    dcp.load(ref, storage_reader=dcp.FileSystemReader(str(fsdir)))
    assert_same(mine, ref, "one process vs FileSystemReader")
    assert_same(mine, full, "one process vs the saved state")
    assert mine["extra"]["epoch"] == 3 and mine["extra"]["cfg"]["name"] == "tiny"


def test_async_save_keeps_the_state_staged_before_it_returned(tmp_path):
    store = str(tmp_path / "store")
    w = torch.randn(1024, 1024)  # 4 MiB: the persist takes a while
    before = w.clone()
    state = {"model": {"w": w}, "step": 1}
    fut = dcp.async_save(state, storage_writer=StorageWriter(store, run="a", step=1))
    staged = getattr(fut, "staging_completion", None)
    if staged is not None:  # AsyncSaveResponse: staging may still run after the return
        staged.result()
    upload = getattr(fut, "upload_completion", fut)
    w.add_(1.0)  # the training loop goes on
    upload.result()
    got = {"model": {"w": torch.zeros_like(w)}, "step": 0}
    dcp.load(got, storage_reader=StorageReader(store, run="a"))
    assert torch.equal(got["model"]["w"], before), "a change after staging reached the checkpoint"
    assert not torch.equal(got["model"]["w"], w)


def _flip_in(store: Path, run: str, step: int, tensor: str) -> None:
    """Flip the last byte of the stored chunk of `tensor` saved by rank 0."""
    steps = store / "runs" / run / "steps"
    manifest = next((steps / f"{step:020d}").rglob("rank-000000.manifest"))
    m = json.loads(manifest.read_text())
    c = next(t for t in m["tensors"] if t["name"] == tensor)["chunks"][0]
    if c.get("pack"):
        path, at = store / "packs" / c["pack"][:2] / c["pack"], c["offset"] + c["stored"] - 1
    else:
        path = store / "chunks" / c["id"][:2] / c["id"]
        at = path.stat().st_size - 1
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.chmod(0o644)
    path.write_bytes(bytes(data))


def test_a_flipped_byte_fails_the_load_naming_the_tensor(tmp_path):
    store = tmp_path / "store"
    dcp.save(small_state(), storage_writer=StorageWriter(str(store), run="f", step=1))
    _flip_in(store, "f", 1, "model.w")
    got = placeholder(small_state())
    with pytest.raises(BaseException) as e:  # DCP's CheckpointException is one
        dcp.load(got, storage_reader=StorageReader(str(store), run="f", step=1))
    # DCP gathers each rank's exception into a CheckpointException.
    failures = getattr(e.value, "failures", {})
    errors = [f[0] if isinstance(f, tuple) else f for f in failures.values()] or [e.value]
    assert any(
        isinstance(x, ckpt.CkptError) and x.kind == "damaged data" and '"model.w"' in str(x)
        for x in errors
    ), repr(failures)
    # The other tensor is intact and still loads.
    b = {"model": {"b": torch.zeros(32, dtype=torch.bfloat16)}}
    dcp.load(b, storage_reader=StorageReader(str(store), run="f", step=1))
    assert torch.equal(b["model"]["b"], small_state()["model"]["b"])


def test_reader_read_into_reads_boxes_across_chunks_and_refuses_a_damaged_one(tmp_path):
    """`Reader.read_into`: a box of a tensor of several chunks reads bit-exact, a box cut
    across the rows too, and a flipped byte fails it naming the tensor."""
    store = tmp_path / "store"
    s = ckpt.Store(str(store))
    t = torch.randn(1024, 3072)  # 12 MiB of f32: three chunks of 4 MiB
    w = s.rank_writer("x", 1, 0, 1)
    w.put([("w", "f32", [1024, 3072], [0, 0], [1024, 3072], t.view(torch.uint8).numpy())])
    w.finish()
    s.commit("x", 1, None)
    reader = s.open_step("x", 1)
    got = torch.zeros(1024, 3072)
    reader.read_into("w", [0, 0], [1024, 3072], got.view(torch.uint8).numpy())
    assert torch.equal(got, t)
    part = torch.zeros(500, 1000)  # rows of every chunk, cut across the columns
    reader.read_into("w", [200, 1000], [500, 1000], part.view(torch.uint8).numpy())
    assert torch.equal(part, t[200:700, 1000:2000])
    _flip_in(store, "x", 1, "w")
    with pytest.raises(ckpt.CkptError) as e:
        s.open_step("x", 1).read_into("w", [0, 0], [1024, 3072], got.view(torch.uint8).numpy())
    assert e.value.kind == "damaged data" and '"w"' in str(e.value), str(e.value)


def test_saving_the_same_state_again_writes_no_chunk(tmp_path):
    store = tmp_path / "store"
    state = small_state()
    dcp.save(state, storage_writer=StorageWriter(str(store), run="d", step=1))
    objects = stored_objects(store)
    assert objects
    w2 = StorageWriter(str(store), run="d", step=2)
    dcp.save(state, storage_writer=w2)
    assert stored_objects(store) == objects
    assert w2.report["chunks_written"] == 0, w2.report
    assert w2.report["chunks_skipped"] == w2.report["chunks"] > 0, w2.report
    # A changed tensor writes its chunks only.
    state["model"]["w"] += 1
    w3 = StorageWriter(str(store), run="d", step=3)
    dcp.save(state, storage_writer=w3)
    assert 0 < w3.report["chunks_written"] < w3.report["chunks"], w3.report


def test_a_step_from_pytorch_exports_to_safetensors_with_its_names(tmp_path, ckpt_bin):
    from safetensors.torch import load_file

    store, out = tmp_path / "store", tmp_path / "export"
    full = full_state()
    state = {k: full[k] for k in ("model", "optim", "emb")}
    dcp.save(state, storage_writer=StorageWriter(str(store), run="x", step=5))
    for args in (["verify", "x"], ["export", "x@5", "--out", str(out)]):
        subprocess.run([str(ckpt_bin), *args], env={"CKPT_STORE": str(store)}, check=True)
    files = list(out.glob("*.safetensors"))
    got = {}
    for f in files:
        got.update(load_file(f))
    want = {k: v for k, v in flat(state) if isinstance(v, torch.Tensor)}
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_the_reader_without_a_step_loads_the_newest_committed_one(tmp_path):
    store = str(tmp_path / "store")
    for step in (1, 2):
        dcp.save(small_state(step), storage_writer=StorageWriter(store, run="n", step=step))
    # Step 3 is written by its only rank but never committed (a save killed before finish).
    s = ckpt.Store(store)
    w = s.rank_writer("n", 3, 0, 1)
    t = small_state(3)["model"]["w"]
    w.put([("model.w", "f32", [64, 32], [0, 0], [64, 32], t.view(torch.uint8).numpy())])
    w.finish()
    assert s.committed_steps("n") == [1, 2]
    got = placeholder(small_state())
    reader = StorageReader(store, run="n")
    dcp.load(got, storage_reader=reader)
    assert reader.checkpoint_step == 2
    assert_same(got, small_state(2), "newest committed step")
    with pytest.raises(BaseException) as e:
        dcp.load(placeholder(small_state()), storage_reader=StorageReader(store, run="n", step=3))
    assert "step 3 of run n is not committed" in str(e.value), str(e.value)
    with pytest.raises(ckpt.CkptError) as e:
        StorageReader(store, run="n", step=3).read_metadata()
    assert e.value.kind == "not found", (e.value.kind, str(e.value))


def test_bad_input_gets_an_error_naming_it(tmp_path):
    s = ckpt.Store(str(tmp_path / "store"))
    w = s.rank_writer("e", 1, 0, 1)
    with pytest.raises(ckpt.CkptError, match='tensor "t".*6 bytes given, 8 expected'):
        w.put([("t", "f32", [2], [0], [2], numpy.zeros(6, dtype=numpy.uint8))])
    with pytest.raises(ckpt.CkptError, match='tensor "t".*not of bytes'):
        w.put([("t", "f32", [2], [0], [2], numpy.zeros(2, dtype=numpy.float32))])


def test_a_ckpt_error_crosses_processes_with_its_message_and_kind(tmp_path):
    # DCP sends a coordinator's exception to every rank pickled: a CkptError must unpickle as
    # itself (it failed with "import of module '_native' failed", hiding the message).
    import pickle

    with pytest.raises(ckpt.CkptError) as e:
        StorageReader(str(tmp_path / "store"), run="n", step=3).read_metadata()
    back = pickle.loads(pickle.dumps(e.value))
    assert type(back) is ckpt.CkptError and back.kind == "not found", repr(back)
    assert str(back) == str(e.value)


def test_the_reader_loads_a_step_written_by_ckpt_import(tmp_path, ckpt_bin):
    from safetensors.torch import save_file

    store, st = tmp_path / "store", tmp_path / "model.safetensors"
    full = full_state()
    want = {k: v.contiguous() for k, v in flat({"model": full["model"], "emb": full["emb"]})}
    save_file(want, str(st))
    subprocess.run(
        [str(ckpt_bin), "import", "--run", "imp", "--step", "3", str(st)],
        env={"CKPT_STORE": str(store)},
        check=True,
    )
    got = placeholder({"model": full["model"], "emb": full["emb"]})
    reader = StorageReader(str(store), run="imp")
    dcp.load(got, storage_reader=reader)
    assert reader.checkpoint_step == 3
    assert_same(got, {"model": full["model"], "emb": full["emb"]}, "imported step")


def test_a_local_tier_commits_there_drains_to_the_store_and_loads_from_either(tmp_path):
    remote, local = tmp_path / "remote", tmp_path / "local"
    state = small_state()
    w = StorageWriter(str(remote), run="t", step=1, local_tier=str(local))
    dcp.save(state, storage_writer=w)
    # Local-durable at once; remote-durable once the drain (a background thread) ends.
    assert ckpt.Store(str(local)).committed_steps("t") == [1]
    figures = w.wait_drained(timeout=120)
    assert figures["bytes_sent"] > 0 and figures["objects_sent"] > 0, figures
    assert ckpt.Store(str(remote)).committed_steps("t") == [1]
    assert ckpt.Store(str(local)).pending_drains("t") == []
    # The store alone (the machine and its tier lost) loads it.
    got = placeholder(small_state())
    dcp.load(got, storage_reader=StorageReader(str(remote), run="t"))
    assert_same(got, state, "the drained step read from the store alone")
    # A second step drains only what changed; the tier keeps its newest keep_local steps.
    state["model"]["w"] += 1
    for step in (2, 3):
        w = StorageWriter(str(remote), run="t", step=step, local_tier=str(local), keep_local=2)
        dcp.save(state, storage_writer=w)
        f = w.wait_drained(timeout=120)
        assert f["bytes_present"] > 0, f  # "model.b" was on the store already
    assert ckpt.Store(str(remote)).committed_steps("t") == [1, 2, 3]
    assert ckpt.Store(str(local)).committed_steps("t") == [2, 3]
    # A damaged local chunk is read from the store: the load is still exact.
    _flip_in(local, "t", 3, "model.w")
    got = placeholder(small_state())
    dcp.load(got, storage_reader=StorageReader(str(remote), run="t", local_tier=str(local)))
    assert_same(got, state, "step 3 through the tier with a damaged local chunk")


def test_a_step_only_in_the_local_tier_loads_and_drain_wait_finishes_in_finish(tmp_path):
    remote, local = tmp_path / "remote", tmp_path / "local"
    state = small_state(1)
    # Committed locally by hand, as a job killed before its drain left it.
    w = StorageWriter(str(local), run="k", step=4)
    dcp.save(state, storage_writer=w)
    assert ckpt.Store(str(remote)).committed_steps("k") == []
    got = placeholder(small_state(1))
    r = StorageReader(str(remote), run="k", local_tier=str(local))
    dcp.load(got, storage_reader=r)
    assert r.checkpoint_step == 4
    assert_same(got, state, "the local-only step")
    # The load drains it behind (test_a_load_drains_what_a_killed_process_left_in_the_tier).
    t0 = time.monotonic()
    while ckpt.Store(str(remote)).committed_steps("k") != [4]:
        assert time.monotonic() - t0 < 60, "step 4 not drained after the load"
        time.sleep(0.02)
    # drain="wait": remote-durable when dcp.save returns.
    state["step"] = 9
    w = StorageWriter(str(remote), run="k", step=5, local_tier=str(local), drain="wait")
    dcp.save(state, storage_writer=w)
    assert ckpt.Store(str(remote)).committed_steps("k") == [4, 5]
    with pytest.raises(ckpt.CkptError, match="drain must be"):
        StorageWriter(str(remote), run="k", step=6, local_tier=str(local), drain="later")


def eight_mib(seed: int) -> dict:
    """Eight tensors of 1 MiB of random floats: eight chunks that neither compress nor dedup."""
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"w{i}": torch.randn(256, 1024, generator=g) for i in range(8)}, "step": seed}


def test_one_dcp_drain_at_a_time_at_its_rate_skipping_older_steps_when_behind(tmp_path):
    remote, local = tmp_path / "remote", tmp_path / "local"
    rate = 2e6  # bytes a second: the first step's drain takes about 4 s, past both saves
    writers = {}
    for step in (1, 2, 3):
        w = StorageWriter(str(remote), run="b", step=step, local_tier=str(local), drain_rate=rate)
        if step == 3:
            # Step 1 still drains and step 2 waits: the newest step takes its place.
            with pytest.warns(RuntimeWarning, match="step 2 is skipped for step 3"):
                dcp.save(eight_mib(step), storage_writer=w)
        else:
            dcp.save(eight_mib(step), storage_writer=w)
        writers[step] = w
    assert writers[2].wait_drained(timeout=120) == {"step": 2, "skipped_for": 3}
    first = writers[1].wait_drained(timeout=120)
    # Paced: each object after the first waited for the bytes before it at the rate (an
    # unpaced drain of 8 MiB between two local directories takes a few milliseconds).
    assert first["bytes_sent"] >= 8 << 20, first
    assert first["seconds"] >= 0.99 * (first["bytes_sent"] - (1 << 20) - (64 << 10)) / rate, first
    third = writers[3].wait_drained(timeout=120)
    assert third["bytes_sent"] >= 8 << 20, third
    assert ckpt.Store(str(remote)).committed_steps("b") == [1, 3]
    assert ckpt.Store(str(local)).pending_drains("b") == []
    got = placeholder(eight_mib(0))
    dcp.load(got, storage_reader=StorageReader(str(remote), run="b"))
    assert_same(got, eight_mib(3), "the newest step, read from the store alone")
    with pytest.raises(ckpt.CkptError, match="drain_rate must be"):
        StorageWriter(str(remote), run="b", step=4, local_tier=str(local), drain_rate=0)


KILLED_MID_DRAIN = """
import os, sys, time
import torch
import torch.distributed.checkpoint as dcp
import ckpt
from ckpt.dcp import StorageWriter
remote, local = sys.argv[1], sys.argv[2]
g = torch.Generator().manual_seed(1)
state = {"model": {f"w{i}": torch.randn(256, 1024, generator=g) for i in range(8)}}
w = StorageWriter(remote, run="k", step=1, local_tier=local, drain_rate=1e5)
dcp.save(state, storage_writer=w)
t = time.monotonic()
while ckpt.Store(local).pending_drains("k") != [1]:
    assert time.monotonic() - t < 60, "the drain never started"
    time.sleep(0.01)
time.sleep(0.3)
os._exit(0)  # killed mid-drain: the interpreter does not wait for the drain thread
"""


def _killed_mid_drain(tmp_path: Path) -> "tuple[Path, Path]":
    """A store and a local tier where a killed process left step 1 of run "k" draining."""
    remote, local = tmp_path / "remote", tmp_path / "local"
    subprocess.run(
        [sys.executable, "-c", KILLED_MID_DRAIN, str(remote), str(local)],
        check=True,
        timeout=120,
    )
    assert ckpt.Store(str(remote)).committed_steps("k") == []
    return remote, local


def test_a_drain_a_killed_process_left_is_superseded_by_the_next_save(tmp_path, ckpt_bin):
    remote, local = _killed_mid_drain(tmp_path)
    assert ckpt.Store(str(local)).pending_drains("k") == [1]
    # The next process that saves to the tier drains its newest step in place of the one left.
    w = StorageWriter(str(remote), run="k", step=2, local_tier=str(local))
    with pytest.warns(RuntimeWarning, match="step 1 is skipped for step 2"):
        dcp.save(eight_mib(2), storage_writer=w)
    assert w.wait_drained(timeout=120)["bytes_sent"] > 0
    assert ckpt.Store(str(remote)).committed_steps("k") == [2]
    assert ckpt.Store(str(local)).pending_drains("k") == []
    for store in (remote, local):
        subprocess.run([str(ckpt_bin), "verify", "k"], env={"CKPT_STORE": str(store)}, check=True)


def _store_down(url: Path, faults: str) -> ckpt.Store:
    """The store at ``url`` opened with ``faults`` injected below few, quick retries (the
    variables are read when a store is opened, so only this handle is affected)."""
    saved = {k: os.environ.get(k) for k in ("CKPT_FAULTS", "CKPT_STORE_RETRY")}
    os.environ["CKPT_FAULTS"] = faults
    os.environ["CKPT_STORE_RETRY"] = "attempts=2,min_ms=10,max_ms=20,timeout_ms=500"
    try:
        return ckpt.Store(str(url))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_a_dcp_drain_is_tried_again_while_the_store_is_down_and_catches_up(tmp_path, monkeypatch):
    from ckpt.dcp import _Drainer

    monkeypatch.setattr(_Drainer, "first_backoff", 0.2)
    remote, local = tmp_path / "remote", tmp_path / "local"
    # Down for the first 8 s after it opened: past the save and the drain's first try.
    down = _store_down(remote, "outage_s=0+8")
    w = StorageWriter(down, run="o", step=1, local_tier=str(local))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        dcp.save(eight_mib(1), storage_writer=w)  # local-durable while the store is down
        assert ckpt.Store(str(local)).committed_steps("o") == [1]
        # Without a timeout the wait reports the first failure; the tries go on behind.
        with pytest.raises(ckpt.CkptError, match="outage"):
            w.wait_drained()
        assert ckpt.Store(str(remote)).committed_steps("o") == []
        got = w.wait_drained(timeout=60)
    assert got["bytes_sent"] >= 8 << 20, got
    assert ckpt.Store(str(remote)).committed_steps("o") == [1]
    assert ckpt.Store(str(local)).pending_drains("o") == []
    assert any("draining step 1" in str(x.message) and "failed" in str(x.message) for x in seen), [
        str(x.message) for x in seen
    ]
    loaded = placeholder(eight_mib(0))
    dcp.load(loaded, storage_reader=StorageReader(str(remote), run="o"))
    assert_same(loaded, eight_mib(1), "the step, read from the store alone")


EXITS_WHILE_DOWN = """
import os, sys
import torch
import torch.distributed.checkpoint as dcp
import ckpt
from ckpt.dcp import StorageWriter
remote, local = sys.argv[1], sys.argv[2]
g = torch.Generator().manual_seed(1)
state = {"model": {f"w{i}": torch.randn(256, 1024, generator=g) for i in range(8)}, "step": 1}
here = ckpt.Store(local)  # opened before the faults are set: only the store is down
os.environ["CKPT_FAULTS"] = "outage_s=0+600"
os.environ["CKPT_STORE_RETRY"] = "attempts=2,min_ms=10,max_ms=20,timeout_ms=500"
down = ckpt.Store(remote)
dcp.save(state, storage_writer=StorageWriter(down, run="x", step=1, local_tier=here))
"""


def test_a_process_exiting_while_the_store_is_down_says_what_stays_local_and_ckpt_drain_finishes_it(
    tmp_path, ckpt_bin
):
    remote, local = tmp_path / "remote", tmp_path / "local"
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-c", EXITS_WHILE_DOWN, str(remote), str(local)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    # It exits without waiting out the outage, and says what is left and how to finish it.
    assert time.monotonic() - t0 < 60
    assert "step 1 is committed in the local tier" in p.stderr, p.stderr
    assert "ckpt --store" in p.stderr and "drain --local-tier" in p.stderr, p.stderr
    assert ckpt.Store(str(local)).committed_steps("x") == [1]
    assert ckpt.Store(str(remote)).committed_steps("x") == []
    env = {"CKPT_STORE": str(remote)}
    out = subprocess.run(
        [str(ckpt_bin), "--json", "drain", "--local-tier", str(local)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(out.stdout)
    assert [(d["run"], d["step"]) for d in report["drained"]] == [("x", 1)], report
    assert report["drained"][0]["bytes_sent"] >= 8 << 20, report
    assert ckpt.Store(str(remote)).committed_steps("x") == [1]
    for store in (remote, local):
        subprocess.run([str(ckpt_bin), "verify", "x"], env={"CKPT_STORE": str(store)}, check=True)
    loaded = placeholder(eight_mib(0))
    dcp.load(loaded, storage_reader=StorageReader(str(remote), run="x"))
    assert_same(loaded, eight_mib(1), "the drained step, read from the store alone")


def test_a_load_drains_what_a_killed_process_left_in_the_tier(tmp_path, ckpt_bin):
    remote, local = _killed_mid_drain(tmp_path)
    loaded = {"model": placeholder(eight_mib(0)["model"])}  # the killed process saved no "step"
    dcp.load(loaded, storage_reader=StorageReader(str(remote), run="k", local_tier=str(local)))
    assert_same(loaded["model"], eight_mib(1)["model"], "step 1, from the local tier")
    # After the load the step drains behind the training, with no save to start it.
    t0 = time.monotonic()
    while ckpt.Store(str(remote)).committed_steps("k") != [1]:
        assert time.monotonic() - t0 < 60, "the load did not drain the step left local only"
        time.sleep(0.05)
    t0 = time.monotonic()
    while ckpt.Store(str(local)).pending_drains("k"):
        assert time.monotonic() - t0 < 60, "the drain marker stayed"
        time.sleep(0.05)
    for store in (remote, local):
        subprocess.run([str(ckpt_bin), "verify", "k"], env={"CKPT_STORE": str(store)}, check=True)


@pytest.mark.parametrize("how", ["dcp", "manager"])
def test_replicas_every_rank_loads_are_read_from_the_disk_once_per_machine(tmp_path, how):
    from _workers import replicas_load

    store, out = tmp_path / "store", tmp_path / "read"
    mp.spawn(replicas_load, args=(2, free_port(), str(store), str(out), how), nprocs=2)
    reads = [int((tmp_path / f"read-{r}").read_text()) for r in (0, 1)]
    stored = sum(p.stat().st_size for p in store.rglob("*") if p.is_file())
    # Both ranks load all 32 MiB. The disk served it (the store was evicted from the page
    # cache), once: ckpt.dcp's coordinator saw both plans read the same boxes, the manager
    # restores whole tensors in a data-parallel layout, so each rank read them through the
    # page cache. Read around it (O_DIRECT), each rank would read all of it.
    assert sum(reads) >= 0.9 * (32 << 20), (reads, stored)
    assert sum(reads) <= 1.3 * stored, (reads, stored)


def test_a_rank_alone_on_its_machine_reads_replicas_around_the_page_cache(tmp_path):
    from _workers import replicas_load

    store, out = tmp_path / "store", tmp_path / "read"
    mp.spawn(
        replicas_load, args=(2, free_port(), str(store), str(out), "manager-alone"), nprocs=2
    )
    reads = [int((tmp_path / f"read-{r}").read_text()) for r in (0, 1)]
    stored = sum(p.stat().st_size for p in store.rglob("*") if p.is_file())
    # Told by the launcher that no other rank process shares its machine (LOCAL_WORLD_SIZE=1),
    # each manager reads the replicas with O_DIRECT, the faster read for a rank alone: nothing
    # lands in the page cache for the other, so each process reads all 32 MiB from the disk.
    for r in reads:
        assert r >= 0.9 * (32 << 20), (reads, stored)


def test_replicas_are_shared_through_the_page_cache_only_by_ranks_of_one_machine(tmp_path):
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    def item(fqn):
        return ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=MetadataIndex(fqn),
            dest_offsets=torch.Size([0]),
            storage_index=MetadataIndex(fqn, torch.Size([0])),
            storage_offsets=torch.Size([0]),
            lengths=torch.Size([8]),
        )

    reader = StorageReader(str(tmp_path), run="m")
    # Every rank loads the replica `w`; only rank 0 loads `v`.
    local = [
        reader.prepare_local_plan(LoadPlan([item("w")] + ([item("v")] if r == 0 else [])))
        for r in range(3)
    ]
    machines = [p.storage_data["machine"] for p in local]
    assert len(set(machines)) == 1 and machines[0], machines

    def shared(plans):
        return [
            sorted(b[0] for b in p.storage_data["shared"])
            for p in reader.prepare_global_plan(plans)
        ]

    # Three ranks of this machine: `w` through the page cache for all of them, `v` around it.
    assert shared(local) == [["w"], ["w"], ["w"]]
    # Rank 2 on another machine: it is alone there, so it reads `w` around the page cache.
    other = dataclasses.replace(local[2], storage_data={"machine": "another-machine"})
    assert shared([local[0], local[1], other]) == [["w"], ["w"], []]
    # Every rank on a machine of its own: nothing is shared.
    alone = [dataclasses.replace(p, storage_data={"machine": f"m{r}"}) for r, p in enumerate(local)]
    assert shared(alone) == [[], [], []]


def test_a_dcp_drainer_keeps_the_outcomes_of_its_newest_steps_only(tmp_path, monkeypatch):
    from ckpt.dcp import _Drainer

    monkeypatch.setattr(_Drainer, "kept_outcomes", 2)
    remote, local = tmp_path / "remote", tmp_path / "local"
    writers = []
    for step in (1, 2, 3):
        w = StorageWriter(str(remote), run="m", step=step, local_tier=str(local), drain="wait")
        dcp.save(small_state(step), storage_writer=w)
        writers.append(w)
    d = _Drainer.of(ckpt.Store(str(local)), ckpt.Store(str(remote)), "m")
    assert sorted(d._done) == [2, 3]
    assert writers[2].wait_drained(timeout=10)["step"] == 3
    with pytest.raises(ckpt.CkptError, match="no longer kept"):
        writers[0].wait_drained(timeout=10)
    assert ckpt.Store(str(remote)).committed_steps("m") == [1, 2, 3]


@pytest.mark.parametrize("how", ["given", "detected"])
def test_machines_with_their_own_tiers_commit_there_and_the_last_drain_commits_the_store(
    tmp_path, ckpt_bin, how
):
    from _workers import dcp_machine_tiers

    store, tiers = tmp_path / "store", tmp_path / "tiers"
    mp.spawn(
        dcp_machine_tiers,
        args=(4, free_port(), str(store), str(tiers), "m", how),
        nprocs=4,
    )
    # Every step whole on the store; in each machine's tier, node commits of its own ranks
    # only (no step commit: no machine holds a step whole), the newest keep_local of them.
    assert ckpt.Store(str(store)).committed_steps("m") == [1, 2, 3]
    tier = ckpt.Store(str(tiers / "machine-0"))
    assert tier.committed_steps("m") == []
    assert tier.node_committed_steps("m") == [2, 3]
    manifests = sorted(p.name for p in (tiers / "machine-0").rglob("*.manifest"))
    assert manifests and all(
        n in ("rank-000000.manifest", "rank-000001.manifest") for n in manifests
    ), manifests
    out = subprocess.run(
        [str(ckpt_bin), "--store", str(store), "--json", "verify", "m"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("how", ["given", "detected"])
def test_a_restarted_job_loads_the_step_every_machine_committed_and_none_drained(
    tmp_path, ckpt_bin, how
):
    """A job of two machines, a tier each, saved step 1 (on the store) and step 2 while the
    store was down, and was killed before draining it: step 2 is in both tiers only. A new
    job's load without `step=` drains it (each machine its ranks, the last commit lands it on
    the store) and loads it, rather than step 1. Where one machine lacks the step, the load
    takes the store's newest, as it does where a machine's drain fails (a damaged chunk)."""
    from _workers import dcp_machine_tiers_left

    store, tiers = tmp_path / "store", tmp_path / "tiers"

    def run(phase, want=0):
        mp.spawn(
            dcp_machine_tiers_left,
            args=(4, free_port(), str(store), str(tiers), "k", how, phase, want),
            nprocs=4,
        )

    remote = step_left_in_the_tiers(tmp_path, run)
    # Step 2 named: not on the store, and the error says where it is and what drains it.
    named = StorageReader(
        str(store), run="k", step=2, local_tier=str(tiers / "machine-1"), node_ranks=[2, 3]
    )
    with pytest.raises(ckpt.CkptError, match="holds its ranks of step 2.*ckpt --store") as e:
        named.read_metadata()
    assert e.value.kind == "not found"
    # Machine 1's objects of step 2 (those the store lacks) damaged: its drain fails, and the
    # load takes step 1, saying why.
    kept = {}
    for path in (tiers / "machine-1").rglob("*"):
        rel = path.relative_to(tiers / "machine-1")
        if path.is_file() and rel.parts[0] in ("chunks", "packs") and not (store / rel).exists():
            kept[path] = path.read_bytes()
            path.write_bytes(bytes(b ^ 0xFF for b in kept[path]))
    assert kept
    run("load-warned", 1)
    assert remote.committed_steps("k") == [1]
    for path, data in kept.items():
        path.write_bytes(data)
    run("load", 2)
    assert remote.committed_steps("k") == [1, 2]
    out = subprocess.run(
        [str(ckpt_bin), "--store", str(store), "--json", "verify", "k"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def _node_save(tier: ckpt.Store, run: str, step: int, rank: int) -> None:
    """Rank `rank` of 2 writes its half of tensor "t" (step's values) in `tier` and commits it
    there as its machine's only rank."""
    w = tier.rank_writer(run, step, rank, 2, 1, node_first=rank)
    half = numpy.full(1024, step * 10 + rank, dtype=numpy.float32)
    w.put([("t", "f32", [2048], [rank * 1024], [1024], half.view(numpy.uint8))])
    w.finish()
    assert tier.commit_node(run, step, 1, [rank], timeout=10) == [rank]


def test_a_machine_drains_the_step_another_machine_drained_before_its_newest(tmp_path):
    """Machine A drained step 1 (the store waits for B's ranks); B, given step 2 to drain,
    drains its ranks of step 1 first, which commits it, then step 2 (waiting for A's)."""
    from ckpt.dcp import _Drainer

    remote = ckpt.Store(str(tmp_path / "remote"))
    a, b = ckpt.Store(str(tmp_path / "a")), ckpt.Store(str(tmp_path / "b"))
    for step in (1, 2):
        _node_save(a, "f", step, 0)
        _node_save(b, "f", step, 1)
    out = a.drain_to(remote, "f", 1, generation=1, node=0)
    assert out["remote_committed"] is False, out
    assert remote.committed_steps("f") == []
    assert b.step_to_follow(remote, "f", 2, 1, 1) == 1
    assert a.step_to_follow(remote, "f", 2, 0, 1) is None  # its own ranks are there

    d = _Drainer.of(b, remote, "f", node=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        d.submit(2, 1, 2, None)
        out = d.wait(2, timeout=60)
    assert any("drains its ranks of it before step 2" in str(w.message) for w in caught), [
        str(w.message) for w in caught
    ]
    assert out["remote_committed"] is False, out  # A's ranks of step 2 are not there
    assert remote.committed_steps("f") == [1]
    # A drains step 2 last: the store has it whole.
    assert a.drain_to(remote, "f", 2, generation=1, node=0)["remote_committed"] is True
    assert remote.committed_steps("f") == [1, 2]
    got = numpy.empty(2048, dtype=numpy.float32)
    remote.open_step("f", 2, source=b).read_into("t", [0], [2048], got.view(numpy.uint8))
    assert (got[:1024] == 20).all() and (got[1024:] == 21).all()


def test_node_ranks_without_a_local_tier_or_without_this_rank_are_refused(tmp_path):
    for make in (StorageWriter, StorageReader):
        with pytest.raises(ckpt.CkptError, match="no local tier is set"):
            make(str(tmp_path / "s"), run="n", step=1, node_ranks=[0])
    # DCP raises what a rank raised in a CheckpointException (a BaseException).
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException) as e:
        dcp.save(
            small_state(),
            storage_writer=StorageWriter(
                str(tmp_path / "s"),
                run="n",
                step=1,
                local_tier=str(tmp_path / "t"),
                node_ranks=[1, 2],
            ),
        )
    assert "node_ranks [1, 2] must list this rank (0)" in str(e.value), e.value
    assert ckpt.Store(str(tmp_path / "s")).committed_steps("n") == []


def test_a_machine_finishes_the_drain_a_killed_process_left_in_its_tier(tmp_path):
    # Both machines committed step 1 in their tiers; machine A drained it, B's process was
    # killed before it drained. B's next drainer finds the step (its node commit, newer than
    # the store's newest) and drains it after a load: the store then has it whole.
    from ckpt.dcp import _Drainer

    remote = ckpt.Store(str(tmp_path / "remote"))
    a, b = ckpt.Store(str(tmp_path / "a")), ckpt.Store(str(tmp_path / "b"))
    _node_save(a, "k", 1, 0)
    _node_save(b, "k", 1, 1)
    assert a.drain_to(remote, "k", 1, generation=1, node=0)["remote_committed"] is False
    d = _Drainer.of(b, remote, "k", node=1)
    assert d.resume_left(None) == 1
    out = d.wait(1, timeout=60)
    assert out["remote_committed"] is True, out
    assert remote.committed_steps("k") == [1]
    # Nothing is left for the next one.
    assert _Drainer(b, remote, "k", node=1).resume_left(None) is None


def test_a_machines_drain_is_tried_again_while_the_store_is_down_and_commits_the_step(
    tmp_path, monkeypatch
):
    # Machine A drained step 1; the store goes down before machine B's drain, which fails,
    # is tried again, and once the store answers brings B's ranks, committing the step.
    from ckpt.dcp import _Drainer

    monkeypatch.setattr(_Drainer, "first_backoff", 0.2)
    remote = ckpt.Store(str(tmp_path / "remote"))
    a, b = ckpt.Store(str(tmp_path / "a")), ckpt.Store(str(tmp_path / "b"))
    _node_save(a, "o", 1, 0)
    _node_save(b, "o", 1, 1)
    assert a.drain_to(remote, "o", 1, generation=1, node=0)["remote_committed"] is False
    down = _store_down(tmp_path / "remote", "outage_s=0+5")
    d = _Drainer.of(b, down, "o", node=1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        d.submit(1, 1, 2, None)
        with pytest.raises(ckpt.CkptError, match="outage"):
            d.wait(1, timeout=None)  # the first failure; the tries go on
        assert remote.committed_steps("o") == []
        out = d.wait(1, timeout=60)
    assert out["remote_committed"] is True, out
    assert remote.committed_steps("o") == [1]
    assert any("draining step 1" in str(x.message) for x in seen), [str(x.message) for x in seen]
