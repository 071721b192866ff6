"""ckpt.dcp as PyTorch's distributed checkpoint storage: round trips resharded against DCP's own
FileSystemWriter/Reader, async_save, damage, dedup, export interop, the newest committed step."""

import io
import json
import socket
import subprocess
from pathlib import Path

import numpy
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import ckpt
from ckpt.dcp import StorageReader, StorageWriter
from conftest import stored_objects
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
    # drain="wait": remote-durable when dcp.save returns.
    state["step"] = 9
    w = StorageWriter(str(remote), run="k", step=5, local_tier=str(local), drain="wait")
    dcp.save(state, storage_writer=w)
    assert ckpt.Store(str(remote)).committed_steps("k") == [5]
    with pytest.raises(ckpt.CkptError, match="drain must be"):
        StorageWriter(str(remote), run="k", step=6, local_tier=str(local), drain="later")
