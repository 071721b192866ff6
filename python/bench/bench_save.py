"""Issue 15's benchmark: DCP with FileSystemWriter vs DCP with ckpt.dcp.StorageWriter vs
ckpt.CheckpointManager, on one state (bf16 weights and fp32 Adam moments, sharded Shard(0)
over the ranks as DTensors), in one run, with the machine's limits measured in the same run.

    python python/bench/bench_save.py --gb 2 --ranks 2 --dir /tmp/bench15 [--json out.json]

Per method, in fresh processes (so each peak RSS is its own): the training-loop stall of an
async save (``dcp.async_save`` until it returns; ``maybe_save`` until it returns), time to
durable (the save's start to its commit / DCP's future done), the load time onto the same
placement and resharded (Shard(1)), peak RSS of a rank, and bytes on disk. FileSystemWriter
fsyncs its files (its default); ckpt's local store does too. Limits: the warm memcpy of the
state (every rank copies its part into warm memory at once, torch ``copy_``, best of 3: what
the stall is held to), a warm memcpy of 256 MiB by one process alone (torch ``copy_`` with its
default intra-op threads) and the disk's sequential write with fsync (1 GiB)."""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.tensor import Shard, distribute_tensor

GIB = 1 << 30


def state_of(total_bytes: int, mesh) -> dict:
    """bf16 weights and fp32 exp_avg/exp_avg_sq (10 bytes a parameter), in layers of 4096
    columns, seeded (the same on every rank, then sharded Shard(0))."""
    params = total_bytes // 10
    cols = 4096
    layers = 8
    rows = max(1, params // (layers * cols))
    g = torch.Generator().manual_seed(0)
    model, optim = {}, {}
    for i in range(layers):
        w = torch.randn(rows, cols, generator=g)
        name = f"layers.{i}.weight"
        model[name] = distribute_tensor(w.to(torch.bfloat16), mesh, [Shard(0)])
        optim[name] = {
            "exp_avg": distribute_tensor(w * 0.01, mesh, [Shard(0)]),
            "exp_avg_sq": distribute_tensor(w.square() * 1e-4, mesh, [Shard(0)]),
            "step": 10,
        }
    return {"model": model, "optim": {"state": optim}, "step": 10}


def like(state, mesh, placement):
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return distribute_tensor(
            torch.zeros(state.shape, dtype=state.dtype), mesh, [placement]
        )
    if isinstance(state, dict):
        return {k: like(v, mesh, placement) for k, v in state.items()}
    return 0 if isinstance(state, int) else state


def _tensors(state):
    if isinstance(state, dict):
        for v in state.values():
            yield from _tensors(v)
    elif isinstance(state, torch.Tensor):
        yield state


def rss_peak() -> int:
    """This process's peak RSS (VmHWM: ru_maxrss survives exec, so a spawned child would
    report its parent's)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(rank, world, port, method, total, root, out):
    import ckpt
    from ckpt.dcp import StorageReader, StorageWriter

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = dist.device_mesh.init_device_mesh("cpu", (world,))
    state = state_of(total, mesh)
    if method == "memcpy":
        # The limit the stall is held to: every rank copies its own part of the state into
        # warm memory at the same time (as a save's snapshot does), torch's copy_ with its
        # default threads; best of 3.
        src = [t.to_local() for t in _tensors(state)]
        dst = [torch.empty_like(t) for t in src]
        best = float("inf")
        for _ in range(4):
            dist.barrier()
            t0 = time.perf_counter()
            for d, t in zip(dst, src):
                d.copy_(t)
            best = min(best, time.perf_counter() - t0)
        with open(os.path.join(out, f"{method}-{rank}.json"), "w") as f:
            json.dump({"memcpy_state_s": best}, f)
        dist.destroy_process_group()
        return
    rss0 = rss_peak()
    where = os.path.join(root, method)
    dist.barrier()
    r = {}
    t0 = time.perf_counter()
    if method == "manager":
        # BENCH_STAGING: "1" (the default) sizes the staging up front (this rank's state,
        # rounded up to 64 MiB): the pool is allocated and faulted in the background from
        # the manager's creation. "ahead" leaves the bound automatic and saves every second
        # step: the loop's first step takes no checkpoint, and sizes and fills the pool for
        # the state it hands over. "0" leaves it automatic and saves at the first step: the
        # first save allocates and faults in its pool itself.
        mode = os.environ.get("BENCH_STAGING", "1")
        staging = -(-sum(t.to_local().numel() * t.to_local().element_size()
                         for t in _tensors(state)) // (64 << 20)) * (64 << 20)
        every = 2 if mode == "ahead" else 1
        mgr = ckpt.CheckpointManager(
            where, run="bench", every_steps=every, governor=False,
            staging_bytes=staging if mode == "1" else 0,
        )
        if mode == "ahead":
            assert not mgr.maybe_save(1, state)
        time.sleep(float(os.environ.get("BENCH_WARMUP_S", "5")))  # the loop's first steps
        dist.barrier()
        r["staged_before_first"] = mgr.staging()["allocated"]
        t0 = time.perf_counter()
        assert mgr.maybe_save(every, state)
        r["stall_s"] = time.perf_counter() - t0
        mgr.wait()  # committed; the manager saves again (finish ends its saving)
        dist.barrier()
        r["durable_s"] = time.perf_counter() - t0
        rep = mgr.last_report()
        r["persist_s"] = rep["persist_s"]
        # A second save of the same state: the warm stall (staging allocated), and a persist
        # that finds every chunk stored.
        t0 = time.perf_counter()
        assert mgr.maybe_save(2 * every, state)
        r["warm_stall_s"] = time.perf_counter() - t0
        mgr.finish()
        dist.barrier()
        r["warm_durable_s"] = time.perf_counter() - t0
    else:
        writer = (
            dcp.FileSystemWriter(where)
            if method == "dcp-fs"
            else StorageWriter(where, run="bench", step=1)
        )
        fut = dcp.async_save(state, storage_writer=writer)
        staged = getattr(fut, "staging_completion", None)
        if staged is not None:
            staged.result()
        r["stall_s"] = time.perf_counter() - t0
        getattr(fut, "upload_completion", fut).result()
        dist.barrier()
        r["durable_s"] = time.perf_counter() - t0
        writer = (
            dcp.FileSystemWriter(where + "-2")
            if method == "dcp-fs"
            else StorageWriter(where, run="bench", step=2)
        )
        t0 = time.perf_counter()
        fut = dcp.async_save(state, storage_writer=writer)
        if getattr(fut, "staging_completion", None) is not None:
            fut.staging_completion.result()
        r["warm_stall_s"] = time.perf_counter() - t0
        getattr(fut, "upload_completion", fut).result()
        dist.barrier()
        r["warm_durable_s"] = time.perf_counter() - t0
    for name, placement in (("load_s", Shard(0)), ("reshard_load_s", Shard(1))):
        target = like(state, mesh, placement)
        dist.barrier()
        t0 = time.perf_counter()
        if method == "manager":
            got = ckpt.CheckpointManager(where, run="bench", final_on_sigterm=False).restore_latest(
                target
            )
            assert got == 2 * every, got
        elif method == "dcp-fs":
            dcp.load(target, storage_reader=dcp.FileSystemReader(where))
        else:
            dcp.load(target, storage_reader=StorageReader(where, run="bench", step=1))
        dist.barrier()
        r[name] = time.perf_counter() - t0
        w = target["model"]["layers.0.weight"].full_tensor()
        assert torch.equal(w, state["model"]["layers.0.weight"].full_tensor()), name
        del target
    r["rss_peak"] = rss_peak()
    r["rss_state"] = rss0
    with open(os.path.join(out, f"{method}-{rank}.json"), "w") as f:
        json.dump(r, f)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def limits(root: str) -> dict:
    src = torch.empty(256 << 20, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    memcpy = src.numel() / best
    path = os.path.join(root, "disk.probe")
    buf = os.urandom(64 << 20)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(16):
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    disk = 16 * len(buf) / (time.perf_counter() - t0)
    os.remove(path)
    return {"memcpy_Bps": memcpy, "disk_write_Bps": disk, "cpus": os.cpu_count()}


def du(path: str) -> int:
    out = subprocess.run(["du", "-sb", path], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=2.0, help="total state, GiB (all ranks)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/bench15")
    ap.add_argument("--methods", default="dcp-fs,ckpt-dcp,manager")
    ap.add_argument("--json", help="write the figures here as well")
    a = ap.parse_args()
    total = int(a.gb * GIB)
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir)
    out = os.path.join(a.dir, "results")
    os.makedirs(out)
    lim = limits(a.dir)
    state_bytes = (total // 10 // (8 * 4096)) * 8 * 4096 * 10
    report = {"state_bytes": state_bytes, "ranks": a.ranks, "limits": lim, "methods": {}}
    per_rank = state_bytes / a.ranks
    mp.spawn(worker, args=(a.ranks, free_port(), "memcpy", total, a.dir, out), nprocs=a.ranks)
    lim["memcpy_state_s"] = max(
        json.load(open(os.path.join(out, f"memcpy-{r}.json")))["memcpy_state_s"]
        for r in range(a.ranks)
    )
    for m in a.methods.split(","):
        mp.spawn(worker, args=(a.ranks, free_port(), m, total, a.dir, out), nprocs=a.ranks)
        ranks = [json.load(open(os.path.join(out, f"{m}-{r}.json"))) for r in range(a.ranks)]
        fig = {k: max(x[k] for x in ranks) for k in ranks[0]}
        fig["bytes_on_disk"] = du(os.path.join(a.dir, m))
        fig["bytes_on_disk"] += du(os.path.join(a.dir, m + "-2")) if os.path.exists(
            os.path.join(a.dir, m + "-2")
        ) else 0
        # Against every rank copying its part at once (the goal's "warm memcpy of the state"),
        # and against one process copying a rank's part alone on the idle machine.
        fig["stall_vs_memcpy_state"] = fig["stall_s"] / lim["memcpy_state_s"]
        fig["warm_stall_vs_memcpy_state"] = fig["warm_stall_s"] / lim["memcpy_state_s"]
        fig["warm_stall_vs_memcpy_alone"] = fig["warm_stall_s"] / (per_rank / lim["memcpy_Bps"])
        report["methods"][m] = fig
        shutil.rmtree(os.path.join(a.dir, m), ignore_errors=True)
        shutil.rmtree(os.path.join(a.dir, m + "-2"), ignore_errors=True)
    ms = report["methods"]
    if "dcp-fs" in ms:
        for m in ms:
            ms[m]["durable_vs_dcp_fs"] = ms[m]["durable_s"] / ms["dcp-fs"]["durable_s"]
    text = json.dumps(report, indent=2)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    sys.exit(main())
