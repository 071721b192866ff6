"""What the tests run: the state of a small trained model, its sharding, and the processes of a
distributed save and load (importable by torch.multiprocessing's spawned children)."""

import contextlib
import copy
import io
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ckpt.dcp import StorageReader, StorageWriter


def leave():
    """End a worker that succeeded without the interpreter's finalization: a gloo worker
    thread that releases a finished collective's tensors (a barrier holds the collectives
    before it) while the interpreter finalizes aborts the process (torch 2.15:
    `AsyncBarrierWork` destroyed in `ProcessGroupGloo::runLoop` takes the GIL, "terminate
    called without an active exception"), a race a worker that exits right after its
    collectives can lose."""
    import sys

    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def store_down(store):
    """The store at `store` opened down for good, for this handle only (the variables are read
    when a store opens)."""
    import ckpt

    os.environ["CKPT_FAULTS"] = "outage_s=0+3600"
    os.environ["CKPT_STORE_RETRY"] = "attempts=2,min_ms=10,max_ms=20,timeout_ms=500"
    try:
        return ckpt.Store(store)
    finally:
        del os.environ["CKPT_FAULTS"], os.environ["CKPT_STORE_RETRY"]


@contextlib.contextmanager
def leaving():
    """Run the block, then `leave()`; a failure destroys the process group and propagates."""
    try:
        yield
    except BaseException:
        dist.destroy_process_group()
        raise
    leave()


def join(rank, world, port):
    """Join the gloo process group of `world` ranks on this machine's `port`."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def full_state() -> dict:
    """A small model and its AdamW state after one step (the same on every process), a bf16
    embedding, and non-tensor items: an int, a nested dict with a list, raw RNG bytes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 6)).square().sum().backward()
    opt.step()
    names = list(model.state_dict().keys())
    osd = opt.state_dict()
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optim": {
            "state": {
                names[i]: {k: v.clone() for k, v in s.items()} for i, s in osd["state"].items()
            },
            "lr": 0.1,
        },
        "emb": torch.randn(16, 4).to(torch.bfloat16),
        "extra": {"epoch": 3, "cfg": {"name": "tiny", "dims": [6, 8, 4]}},
        "rng": io.BytesIO(torch.get_rng_state().numpy().tobytes()),
    }


def placeholder(v):
    """A value of the same structure to load into: zeros, 0, "", same-length lists."""
    if isinstance(v, torch.Tensor):
        return torch.zeros_like(v)
    if isinstance(v, dict):
        return {k: placeholder(x) for k, x in v.items()}
    if isinstance(v, list):
        return [placeholder(x) for x in v]
    if isinstance(v, io.BytesIO):
        return io.BytesIO()
    if isinstance(v, str):
        return ""
    return type(v)(0)


def distribute(state, mesh, placement):
    """Every tensor of at least one dimension as a DTensor placed by `placement(tensor)`."""
    if isinstance(state, torch.Tensor):
        if state.dim() == 0 or mesh is None:
            return state.clone()
        return distribute_tensor(state, mesh, [placement(state)])
    if isinstance(state, dict):
        return {k: distribute(v, mesh, placement) for k, v in state.items()}
    if isinstance(state, list):
        return [distribute(v, mesh, placement) for v in state]
    if isinstance(state, io.BytesIO):
        return io.BytesIO(state.getvalue())
    return copy.deepcopy(state)


def flat(state, prefix=""):
    """(name, value) of every leaf; DTensors gathered to full tensors (a collective)."""
    if isinstance(state, dict):
        for k, v in state.items():
            yield from flat(v, f"{prefix}{k}.")
    elif isinstance(state, list):
        for i, v in enumerate(state):
            yield from flat(v, f"{prefix}{i}.")
    elif isinstance(state, DTensor):
        yield prefix[:-1], state.full_tensor()
    elif isinstance(state, io.BytesIO):
        yield prefix[:-1], state.getvalue()
    else:
        yield prefix[:-1], state


def assert_same(got, want, what):
    g, w = dict(flat(got)), dict(flat(want))
    assert g.keys() == w.keys(), f"{what}: keys {sorted(g)} != {sorted(w)}"
    for k in w:
        if isinstance(w[k], torch.Tensor):
            assert g[k].dtype == w[k].dtype, f"{what}: {k} dtype {g[k].dtype} != {w[k].dtype}"
            assert torch.equal(g[k], w[k]), f"{what}: tensor {k} differs"
        else:
            assert g[k] == w[k], f"{what}: {k} = {g[k]!r}, expected {w[k]!r}"


def shard1(t):
    return Shard(1) if t.dim() >= 2 else Replicate()


def roundtrip(rank, world, port, store, fsdir, run):
    """Save Shard(0) through ckpt and through DCP's FileSystemWriter; load Shard(1) and
    Replicate() from both and compare; save the same state again as step 2 and check that no
    rank wrote a chunk."""
    join(rank, world, port)
    try:
        mesh = dist.device_mesh.init_device_mesh("cpu", (world,))
        full = full_state()
        state = distribute(full, mesh, lambda t: Shard(0))
        w1 = StorageWriter(store, run=run, step=1)
        dcp.save(state, storage_writer=w1)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(fsdir))
        for name, placement in (("Shard(1)", shard1), ("Replicate()", lambda t: Replicate())):
            mine = distribute(placeholder(full), mesh, placement)
            dcp.load(mine, storage_reader=StorageReader(store, run=run, step=1))
            ref = distribute(placeholder(full), mesh, placement)
            dcp.load(ref, storage_reader=dcp.FileSystemReader(fsdir))
            w = mine["model"]["0.weight"]
            assert w.placements == (placement(w),), f"{name}: placed {w.placements}"
            assert_same(mine, ref, f"rank {rank} loading {name} vs FileSystemReader")
            assert_same(mine, full, f"rank {rank} loading {name} vs the saved state")
        # The same state again: every chunk is in the store already.
        w2 = StorageWriter(store, run=run, step=2)
        dcp.save(state, storage_writer=w2)
        assert w1.report["chunks_written"] > 0, w1.report
        assert w2.report["chunks_written"] == 0, f"rank {rank}: {w2.report}"
        dist.barrier()
    finally:
        dist.destroy_process_group()


def manager_roundtrip(rank, world, port, store, run, local_tier=None, per_machine=False):
    """The native manager: save Shard(0) (every rank what it holds), restore Shard(1) and
    Replicate() in fresh managers, each equal to the saved state (non-tensor items too).
    `local_tier`: every manager saves to and restores from that tier under `store`;
    `per_machine`: each rank as a machine of its own, with its own tier below `local_tier`,
    given as `node_ranks` (True) or found by the machine each rank says it runs on
    ("detected")."""
    import ckpt
    import ckpt.dcp

    node_ranks = None
    if per_machine:
        local_tier = os.path.join(local_tier, f"node-{rank}")
        if per_machine == "detected":
            ckpt.dcp._machine = lambda: f"machine-{rank}"
        else:
            node_ranks = [rank]

    join(rank, world, port)
    with leaving():
        mesh = dist.device_mesh.init_device_mesh("cpu", (world,))
        full = full_state()
        state = distribute(full, mesh, lambda t: Shard(0))
        mgr = ckpt.CheckpointManager(
            store, run=run, every_steps=1, local_tier=local_tier, node_ranks=node_ranks
        )
        assert mgr.restore_latest(distribute(placeholder(full), mesh, lambda t: Shard(0))) is None
        assert mgr.maybe_save(1, state)
        mgr.finish()
        dist.barrier()
        for name, placement in (("Shard(1)", shard1), ("Replicate()", lambda t: Replicate())):
            mine = distribute(placeholder(full), mesh, placement)
            got = ckpt.CheckpointManager(
                store, run=run, local_tier=local_tier, node_ranks=node_ranks
            ).restore_latest(mine)
            assert got == 1, got
            w = mine["model"]["0.weight"]
            assert w.placements == (placement(w),), f"{name}: placed {w.placements}"
            assert_same(mine, full, f"rank {rank} restoring {name} vs the saved state")
        dist.barrier()


def manager_sigterm(rank, world, port, store, run, progress):
    """A loop that saves rarely: a SIGTERM to one rank makes every rank take a final
    checkpoint of the same step and stop; writes `<progress>/rank-<r>` (the step reached) and
    `<progress>/final-<r>` (the step of the final checkpoint)."""
    import time

    import ckpt

    join(rank, world, port)
    try:
        w = torch.zeros(64, 64)
        state = {"model": {"w": w}, "step": 0}
        mgr = ckpt.CheckpointManager(store, run=run, every_steps=100_000)
        for step in range(1, 100_000):
            w.fill_(float(step))
            state["step"] = step
            dist.all_reduce(torch.ones(1))  # the ranks step together, as in training
            with open(os.path.join(progress, f"rank-{rank}"), "w") as f:
                f.write(str(step))
            time.sleep(0.02)
            mgr.maybe_save(step, state)
            if mgr.should_stop:
                with open(os.path.join(progress, f"final-{rank}"), "w") as f:
                    f.write(str(step))
                break
        mgr.finish()
    finally:
        dist.destroy_process_group()


def manager_ddp_bitflip(rank, world, port, store, run, flip_rank, flip_after):
    """DDP over gloo with the native manager and the sentinel in full: after step
    `flip_after`'s update, rank `flip_rank` flips one bit of its copy of the first layer's
    weight (silent data corruption); checkpoints every 2 steps."""
    import ckpt
    from torch.nn.parallel import DistributedDataParallel as DDP

    join(rank, world, port)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)
        )
        ddp = DDP(model)
        opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
        mgr = ckpt.CheckpointManager(
            store, run=run, every_steps=2, sdc_check="full", trainable=model
        )
        gen = torch.Generator().manual_seed(1000 + rank)
        for step in range(1, 7):
            x = torch.randn(16, 64, generator=gen)
            loss = ddp(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if rank == flip_rank and step == flip_after:
                with torch.no_grad():
                    bits = model[0].weight.view(torch.int32)
                    bits[0, 0] ^= 1 << 20
            mgr.maybe_save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
        mgr.finish()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def disk_read_bytes() -> int:
    """Bytes this process has had read from the block device so far (``/proc/self/io``)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    raise RuntimeError("no read_bytes in /proc/self/io")


def evict(root: str) -> None:
    """Drop every file under ``root`` from the page cache (clean pages: no root needed)."""
    for d, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def replicated_state() -> dict:
    """32 MiB of distinct random floats in 8 tensors, the same on every rank (a data-parallel
    model: every rank loads all of it)."""
    g = torch.Generator().manual_seed(7)
    return {"model": {f"w{i}": torch.randn(1024, 1024, generator=g) for i in range(8)}}


def replicas_load(rank, world, port, store, out, how):
    """Save the replicated state once, evict the store from the page cache, load it on every
    rank (``how``: "dcp", through ckpt.dcp; "manager", a fresh native manager; "manager-alone",
    one told by ``LOCAL_WORLD_SIZE=1`` that no other rank process runs on its machine), and
    write what the load cost this process in disk reads to ``out``-RANK."""
    import ckpt

    join(rank, world, port)
    try:
        state = replicated_state()
        if how == "dcp":
            dcp.save(state, storage_writer=StorageWriter(store, run="ddp", step=1))
        else:
            m = ckpt.CheckpointManager(store, run="ddp", every_steps=1, final_on_sigterm=False)
            m.maybe_save(1, state)
            m.finish()
        dist.barrier()
        if rank == 0:
            evict(store)
        dist.barrier()
        got = placeholder(state)
        before = disk_read_bytes()
        if how == "dcp":
            dcp.load(got, storage_reader=StorageReader(store, run="ddp", step=1))
        else:
            if how == "manager-alone":
                os.environ["LOCAL_WORLD_SIZE"] = "1"
            m = ckpt.CheckpointManager(store, run="ddp", final_on_sigterm=False)
            assert m.restore_latest(got) == 1
        read = disk_read_bytes() - before
        assert_same(got, state, f"rank {rank}")
        with open(f"{out}-{rank}", "w") as f:
            f.write(str(read))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def machine_of(rank, world, tiers, how):
    """Rank `rank`'s "machine" of two (world / 2 ranks each): its ranks, its local tier below
    `tiers` (machine-0, machine-1), and the `node_ranks=` to pass: its ranks (`how` "given"),
    or None with this process made to say it runs on its machine (`how` "detected")."""
    import ckpt.dcp

    half = world // 2
    machine = rank // half
    node = list(range(machine * half, (machine + 1) * half))
    if how == "detected":
        ckpt.dcp._machine = lambda: f"machine-{machine}"
    return node, os.path.join(tiers, f"machine-{machine}"), node if how == "given" else None


def stepped(full, step):
    """`full` with every model weight moved by `step`: each step's state differs."""
    out = copy.deepcopy(full)
    for k, v in out["model"].items():
        out["model"][k] = v + step
    return out


def dcp_machine_tiers(rank, world, port, store, tiers, run, how):
    """Two "machines" of world / 2 ranks, each with its own local tier below `tiers`
    (machine-0, machine-1), told apart by `node_ranks=` (`how` "given") or by the machine
    each rank says it runs on (`how` "detected"). Saves steps 1-3 through the tiers (1 and 2
    with drain="wait"), loads step 3 resharded from the tiers; reads machine 0's shards from
    its tier with the store's chunks gone; then loads again with machine 1's tier lost and
    every chunk of machine 0's damaged, from the store. Each load must equal the saved
    state."""
    import shutil

    import ckpt

    node, tier, node_ranks = machine_of(rank, world, tiers, how)
    join(rank, world, port)
    with leaving():
        mesh = dist.device_mesh.init_device_mesh("cpu", (world,))
        full = full_state()
        for step in (1, 2, 3):
            w = StorageWriter(
                store,
                run=run,
                step=step,
                local_tier=tier,
                node_ranks=node_ranks,
                drain="wait" if step < 3 else "background",
            )
            dcp.save(distribute(stepped(full, step), mesh, lambda t: Shard(0)), storage_writer=w)
            if step < 3 and rank == 0:
                # drain="wait": the coordinator returns once the store has the step whole.
                assert step in ckpt.Store(store).committed_steps(run), step
            if rank == min(node):
                out = w.wait_drained(timeout=120)
                assert out is not None and "remote_committed" in out, out
            else:
                assert w.wait_drained() is None
        dist.barrier()
        want = stepped(full, 3)

        def load(what):
            mine = distribute(placeholder(full), mesh, shard1)
            r = StorageReader(store, run=run, local_tier=tier, node_ranks=node_ranks)
            dcp.load(mine, storage_reader=r)
            assert r.checkpoint_step == 3, r.checkpoint_step
            assert_same(mine, want, f"rank {rank}, {what}")

        load("through the tiers")
        dist.barrier()
        # With the store's chunks gone (kept aside), machine 0's shards of the step come from
        # its tier alone (no machine can load the whole step so: the other's shards and the
        # coordinator's metadata are on the store only).
        if rank == 0:
            for d in ("chunks", "packs"):
                if os.path.exists(os.path.join(store, d)):
                    shutil.move(os.path.join(store, d), os.path.join(tiers, f"store-{d}"))
            reader = ckpt.Store(store).open_step(run, 3, source=ckpt.Store(tier))
            n = 2 * len(node)  # the rows of machine 0's ranks
            rows = torch.zeros(n, 6)
            reader.read_into("model.0.weight", [0, 0], [n, 6], rows.view(torch.uint8).numpy())
            assert torch.equal(rows, want["model"]["0.weight"][:n]), "from the tier"
            for d in ("chunks", "packs"):
                if os.path.exists(os.path.join(tiers, f"store-{d}")):
                    shutil.move(os.path.join(tiers, f"store-{d}"), os.path.join(store, d))
        dist.barrier()
        # Machine 1 lost with its tier, every chunk of machine 0's tier damaged: from the store.
        if rank == 0:
            shutil.rmtree(os.path.join(tiers, "machine-1"))
            os.makedirs(os.path.join(tiers, "machine-1"))
            damaged = 0
            for kind in ("chunks", "packs"):
                for d, _, files in os.walk(os.path.join(tiers, "machine-0", kind)):
                    for name in files:
                        with open(os.path.join(d, name), "r+b") as f:
                            data = f.read()
                            f.seek(0)
                            f.write(bytes(b ^ 0xFF for b in data))
                        damaged += 1
            assert damaged > 0
        dist.barrier()
        load("machine 1 lost, machine 0's chunks damaged")
        dist.barrier()


def dcp_machine_tiers_left(rank, world, port, store, tiers, run, how, phase, want_step):
    """Two "machines" of world / 2 ranks, each with its own local tier below `tiers` (told
    apart as in `dcp_machine_tiers`). Phase "drained": save step 1, drained to the store.
    Phase "killed": save step 2 while the store is down (committed in each machine's tier
    only, the drains failing), then die (`os._exit`) before a drain is tried again. Phase
    "load": load without `step=`, resharded, which must find step `want_step` and equal its
    state; phase "load-warned" too, and rank 0 is warned that a drain failed."""
    node, tier, node_ranks = machine_of(rank, world, tiers, how)
    join(rank, world, port)
    mesh = dist.device_mesh.init_device_mesh("cpu", (world,))
    full = full_state()
    if phase.startswith("load"):
        import warnings

        with leaving():
            mine = distribute(placeholder(full), mesh, shard1)
            r = StorageReader(store, run=run, local_tier=tier, node_ranks=node_ranks)
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                dcp.load(mine, storage_reader=r)
            said = [str(x.message) for x in seen]
            if phase == "load-warned" and rank == 0:
                assert any("bringing it there failed" in m for m in said), said
            assert r.checkpoint_step == want_step, r.checkpoint_step
            assert_same(mine, stepped(full, want_step), f"rank {rank}, step {want_step}")
    step = 1 if phase == "drained" else 2
    w = StorageWriter(
        store if phase == "drained" else store_down(store),
        run=run,
        step=step,
        local_tier=tier,
        node_ranks=node_ranks,
        drain="wait" if phase == "drained" else "background",
    )
    dcp.save(distribute(stepped(full, step), mesh, lambda t: Shard(0)), storage_writer=w)
    dist.barrier()
    if phase == "killed":
        os._exit(0)  # the drains die with the process
    leave()


def manager_machine_tiers_left(rank, world, port, store, tiers, run, phase, want_step):
    """`dcp_machine_tiers_left` through the native manager (machines given by `node_ranks`):
    phase "drained" saves step 1, drained; "killed" saves step 2 while the store is down and
    dies before its drain; "load" restores resharded and must find `want_step`."""
    import ckpt

    node, tier, _ = machine_of(rank, world, tiers, "given")
    join(rank, world, port)
    mesh = dist.device_mesh.init_device_mesh("cpu", (world,))
    full = full_state()
    if phase == "load":
        with leaving():
            mine = distribute(placeholder(full), mesh, shard1)
            mgr = ckpt.CheckpointManager(store, run=run, local_tier=tier, node_ranks=node)
            got = mgr.restore_latest(mine)
            assert got == want_step, got
            assert_same(mine, stepped(full, want_step), f"rank {rank}, step {want_step}")
    step = 1 if phase == "drained" else 2
    mgr = ckpt.CheckpointManager(
        store if phase == "drained" else store_down(store),
        run=run,
        every_steps=1,
        local_tier=tier,
        node_ranks=node,
        final_on_sigterm=False,
    )
    assert mgr.maybe_save(step, distribute(stepped(full, step), mesh, lambda t: Shard(0)))
    if phase == "drained":
        mgr.finish()
        dist.barrier()
        leave()
    mgr.wait()  # committed in the machine's tier
    dist.barrier()
    os._exit(0)  # the drains die with the process


def plain_sizes() -> "dict":
    """Tensors every rank holds whole (DDP's state), of sizes that `zlib.crc32` of their names
    spreads unevenly over 2 ranks: bytes (uint8), so nothing compresses."""
    mib = {
        "embed.weight": 5, "attn.wq": 2, "attn.wk": 2, "attn.wv": 2, "attn.wo": 2,
        "mlp.w1": 4, "mlp.w2": 4, "mlp.w3": 4, "norm.weight": 1, "head.weight": 5,
    }
    return {k: n << 20 for k, n in mib.items()}


def manager_plain_writers(rank, world, port, store, run, out, how="plain"):
    """Save the same tensors on every rank through the native manager (plain tensors, or
    DTensors `Replicate()` on a mesh of every rank: how="replicate"), write this rank's save
    report to `out`/rank-N.json, then restore into zeros and compare."""
    import json

    import ckpt

    join(rank, world, port)
    with leaving():
        g = torch.Generator().manual_seed(11)
        state = {
            k: torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
            for k, n in plain_sizes().items()
        }
        if how == "replicate":
            mesh = dist.device_mesh.init_device_mesh("cpu", (world,))
            state = distribute(state, mesh, lambda t: Replicate())
        mgr = ckpt.CheckpointManager(store, run=run, every_steps=1, final_on_sigterm=False)
        assert mgr.maybe_save(1, state)
        report = mgr.wait()
        mgr.finish()
        with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
            json.dump(report, f)
        dist.barrier()
        got = {k: torch.zeros_like(v) for k, v in state.items()}
        assert ckpt.CheckpointManager(store, run=run, final_on_sigterm=False).restore_latest(got) == 1
        for k in state:
            a, b = got[k], state[k]
            if how == "replicate":
                a, b = a.to_local(), b.to_local()
            assert torch.equal(a, b), k
        dist.barrier()
