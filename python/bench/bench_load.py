"""Issue 27's benchmark: loads. DCP's FileSystemReader vs ckpt.dcp.StorageReader vs
ckpt.CheckpointManager.restore_latest, on one state saved once by each, each load in fresh
processes, on a cold page cache (dropped first: run as root) and a hot one, with the disk's
O_DIRECT read of the bytes each method reads measured in the same run. "hot" is the load right
after the cold one (DCP's files are then in the page cache, ckpt's objects are not: its reads
are O_DIRECT); "cached" reads every file buffered first, so both find theirs in the cache.

    python python/bench/bench_load.py --gb 2 --ranks 1 --dir /tmp/bench27 [--json out.json]
    python python/bench/bench_load.py --gb 2 --ranks 2 --reshard --dir /tmp/bench27
    python python/bench/bench_load.py --gb 2 --ranks 2 --replicate \
        --methods dcp-fs,ckpt-dcp,ckpt-dcp-noshare --dir /tmp/bench27

The state: ``--tensors`` fp32 tensors (torch.randn, seeded) of ``--gb`` GiB in all, as
DTensors sharded Shard(0) over ``--ranks`` ranks (gloo, CPU). A load restores into tensors
allocated and zero-filled before the clock starts (a restarted trainer's model), onto the
same placement and, with ``--reshard``, onto Shard(1); with ``--replicate``, onto Replicate()
(every rank loads all of it: data-parallel replicas). ``ckpt-dcp-noshare`` is ``ckpt-dcp``
without the boxes several ranks read marked for the page cache (each rank reads them with
O_DIRECT, as before that change). Its time is the slowest rank's, from a
barrier before to a barrier after; its peak RSS the largest rank's, taken before the check.
Every load is checked bit for bit against the state. The limit: every file of the method's
store read with O_DIRECT (``ckpt-bench read-limit``), right after the load it pairs with.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import socket
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

GIB = 1 << 30
COLS = 4096


def shapes_of(total: int, tensors: int) -> dict:
    rows = max(1, total // 4 // tensors // COLS)
    return {f"layers.{i}.weight": (rows, COLS) for i in range(tensors)}


def full_state(total: int, tensors: int) -> dict:
    g = torch.Generator().manual_seed(27)
    return {k: torch.randn(*s, generator=g) for k, s in shapes_of(total, tensors).items()}


def sharded(full: dict, mesh, placement) -> dict:
    return {k: distribute_tensor(v, mesh, [placement]) for k, v in full.items()}


def rss_peak() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def init(rank: int, world: int, port: int):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return dist.device_mesh.init_device_mesh("cpu", (world,))


def save_worker(rank, world, port, method, total, tensors, root):
    import ckpt
    from ckpt.dcp import StorageWriter

    mesh = init(rank, world, port)
    state = sharded(full_state(total, tensors), mesh, Shard(0))
    where = os.path.join(root, method)
    if method == "dcp-fs":
        dcp.save(state, storage_writer=dcp.FileSystemWriter(where))
    elif method.startswith("ckpt-dcp"):
        dcp.save(state, storage_writer=StorageWriter(where, run="bench", step=1))
    else:
        m = ckpt.CheckpointManager(where, run="bench", every_steps=1, final_on_sigterm=False)
        m.maybe_save(1, state)
        m.finish()
    dist.barrier()
    dist.destroy_process_group()


def load_worker(rank, world, port, method, total, tensors, root, placement, out):
    import ckpt
    from ckpt.dcp import StorageReader

    class NoShare(StorageReader):
        def prepare_global_plan(self, plans):
            return plans

    mesh = init(rank, world, port)
    place = {"same": Shard(0), "reshard": Shard(1), "replicate": Replicate()}[placement]
    target = {
        k: distribute_tensor(torch.zeros(s), mesh, [place])
        for k, s in shapes_of(total, tensors).items()
    }
    rss0 = rss_peak()
    where = os.path.join(root, method)
    dist.barrier()
    t0 = time.perf_counter()
    if method == "dcp-fs":
        dcp.load(target, storage_reader=dcp.FileSystemReader(where))
    elif method == "ckpt-dcp":
        dcp.load(target, storage_reader=StorageReader(where, run="bench", step=1))
    elif method == "ckpt-dcp-noshare":
        dcp.load(target, storage_reader=NoShare(where, run="bench", step=1))
    else:
        m = ckpt.CheckpointManager(where, run="bench", final_on_sigterm=False)
        assert m.restore_latest(target) == 1
    dist.barrier()
    secs = time.perf_counter() - t0
    peak = rss_peak()
    # The check, outside the clock and the peak: every local shard against the state's.
    want = sharded(full_state(total, tensors), mesh, place)
    exact = all(torch.equal(target[k].to_local(), want[k].to_local()) for k in target)
    with open(os.path.join(out, f"{method}-{placement}-{rank}.json"), "w") as f:
        json.dump({"secs": secs, "rss_peak": peak, "rss_before": rss0, "bit_exact": exact}, f)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def odirect_read(root: str, limit_bin: str) -> tuple[float, int]:
    """Seconds to read every file under ``root`` with O_DIRECT (``ckpt-bench read-limit``:
    the fastest of 8 and 16 requests of 8 MiB in flight), and the bytes read; without the
    binary, the same read from Python threads (slower than the disk: a floor, not the limit)."""
    if limit_bin and os.path.exists(limit_bin):
        import subprocess

        got = subprocess.run([limit_bin, "read-limit", "--dir", root], check=True,
                             capture_output=True, text=True)
        v = json.loads(got.stdout.strip().splitlines()[-1])
        return v["secs"], v["bytes"]
    return odirect_read_py(root)


def odirect_read_py(root: str, inflight: int = 8, piece: int = 8 << 20) -> tuple[float, int]:
    jobs, total = [], 0
    for d, _, files in os.walk(root):
        for n in files:
            p = os.path.join(d, n)
            size = os.path.getsize(p)
            total += size
            jobs.extend((p, off) for off in range(0, size, piece))
    lock = threading.Lock()

    def run():
        buf = mmap.mmap(-1, piece)
        fds = {}
        while True:
            with lock:
                if not jobs:
                    break
                p, off = jobs.pop()
            fd = fds.get(p)
            if fd is None:
                fd = fds[p] = os.open(p, os.O_RDONLY | os.O_DIRECT)
            os.preadv(fd, [buf], off)
        for fd in fds.values():
            os.close(fd)

    jobs.reverse()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=run) for _ in range(inflight)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=2.0, help="total state, GiB (all ranks)")
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--dir", default="/tmp/bench27")
    ap.add_argument("--methods", default="dcp-fs,ckpt-dcp,manager")
    ap.add_argument("--caches", default="cold,hot,cached",
                    help="cold: dropped first; hot: right after the cold load; cached: every "
                    "file read buffered first")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reshard", action="store_true", help="also load onto Shard(1)")
    ap.add_argument("--replicate", action="store_true",
                    help="also load onto Replicate() (every rank all of it)")
    ap.add_argument("--json", help="write the figures here as well")
    ap.add_argument("--limit-bin", default=os.path.join(
        os.path.dirname(__file__), "..", "..", "target", "debug", "ckpt-bench"),
        help="ckpt-bench, for the O_DIRECT read limit")
    a = ap.parse_args()
    total = int(a.gb * GIB)
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir)
    out = os.path.join(a.dir, "results")
    os.makedirs(out)
    methods = a.methods.split(",")
    placements = ["same"] + ["reshard"] * a.reshard + ["replicate"] * a.replicate
    for m in methods:
        mp.spawn(save_worker, args=(a.ranks, free_port(), m, total, a.tensors, a.dir),
                 nprocs=a.ranks)
    rows = []
    for rnd in range(a.rounds):
        for m in methods:
            for placement in placements:
                for cache in a.caches.split(","):
                    if cache == "cached":
                        # Every file of the method's store in the page cache, read buffered (as
                        # a copy, or a reader that reads buffered, leaves them).
                        for d, _, files in os.walk(os.path.join(a.dir, m)):
                            for n in files:
                                with open(os.path.join(d, n), "rb") as f:
                                    while f.read(64 << 20):
                                        pass
                    if cache == "cold" and not drop_caches():
                        print("cold: cannot drop the page cache (not root); skipped",
                              file=sys.stderr)
                        continue
                    mp.spawn(load_worker, args=(a.ranks, free_port(), m, total, a.tensors,
                                                a.dir, placement, out), nprocs=a.ranks)
                    ranks = [json.load(open(os.path.join(out, f"{m}-{placement}-{r}.json")))
                             for r in range(a.ranks)]
                    lim, stored = odirect_read(os.path.join(a.dir, m), a.limit_bin)
                    row = {
                        "round": rnd, "method": m, "placement": placement, "cache": cache,
                        "secs": max(x["secs"] for x in ranks),
                        "rss_peak": max(x["rss_peak"] for x in ranks),
                        "rss_before": max(x["rss_before"] for x in ranks),
                        "bit_exact": all(x["bit_exact"] for x in ranks),
                        "odirect_read_s": lim, "stored_bytes": stored,
                    }
                    row["x_odirect_read"] = row["secs"] / lim
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    # Medians over the rounds, and each against DCP's load of the same kind.
    summary = {}
    for r in rows:
        key = f'{r["method"]}/{r["placement"]}/{r["cache"]}'
        summary.setdefault(key, []).append(r)
    med = {}
    for key, rs in summary.items():
        med[key] = {
            "secs": statistics.median(x["secs"] for x in rs),
            "x_odirect_read": statistics.median(x["x_odirect_read"] for x in rs),
            "rss_peak_gb": max(x["rss_peak"] for x in rs) / 1e9,
            "bit_exact": all(x["bit_exact"] for x in rs),
        }
    for key, v in med.items():
        _, placement, cache = key.split("/")
        d = med.get(f"dcp-fs/{placement}/{cache}")
        if d:
            v["x_dcp"] = v["secs"] / d["secs"]
        s = med.get(key.replace(f"/{placement}/", "/same/"))
        if placement != "same" and s:
            v["x_own_same"] = v["secs"] / s["secs"]
    report = {"state_bytes": total, "ranks": a.ranks, "tensors": a.tensors, "medians": med,
              "rows": rows}
    print(json.dumps({"medians": med}, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
