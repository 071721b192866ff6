"""A storage backend of PyTorch Distributed Checkpoint (``torch.distributed.checkpoint``).

Existing DCP code switches by changing one argument::

    import torch.distributed.checkpoint as dcp
    from ckpt.dcp import StorageWriter, StorageReader
    dcp.save(state_dict, storage_writer=StorageWriter("/data/ckpts", run="llama", step=100))
    dcp.load(state_dict, storage_reader=StorageReader("/data/ckpts", run="llama"))  # newest

DCP's planners keep doing the resharding. Every tensor write item becomes a shard of an
ordinary ckpt tensor (its name the fully qualified name, its box the item's chunk offsets and
sizes), cut into content-addressed chunks (dedup, codecs, blake3); ``BytesIO`` items (and the
non-tensor values DCP pickles) become blobs of the rank that wrote them. Each rank writes its
manifest; the coordinator adds DCP's ``Metadata`` (pickled, as the blob ``dcp.metadata``) and
commits in ``finish``, so a step is visible only when complete, and ``ckpt ls``, ``inspect``,
``verify``, ``export`` work on it.

A local tier under the store (``local_tier=``, a directory on the node's disk, or
``CKPT_LOCAL_TIER`` from ``ckpt resume --local-tier``): ``StorageWriter`` writes and commits
the step there, at the local disk's speed, then the coordinator drains it to the store in a
background thread (only the chunks the store lacks, hash-checked; ``wait_drained()`` waits
for it, and the process does not exit before it ends); the tier keeps its newest
``keep_local`` steps. One drain runs at a time per tier, store and run: a step saved while an
older one drains waits, and when the drain falls behind it takes the newest step and skips
the older waiting ones (a ``RuntimeWarning`` says so) rather than fall further behind. The
first save of a process to the tier supersedes in the same way a newest step that a killed
process left there undrained (a warning names it). DCP tells a writer nothing of the training
steps, so no governor paces this drain: ``drain_rate=`` caps it in stored bytes a second.
A drain that fails for the store's sake (down, failing requests) is tried again after a
pause that doubles up to 30 s, until it succeeds or a newer step supersedes it; a process
that exits meanwhile warns which step stays local only, and ``ckpt drain --local-tier DIR``
finishes it. ``StorageReader`` loads the newest step of either, reading the local tier first
and a chunk missing or damaged there from the store; after the load its coordinator drains a
step a killed process left in the tier only.

Several machines, each with its own tier (``local_tier=`` naming a directory on each
machine's disk, or ``ckpt agent --local-tier``): the ranks of each machine (told apart by the
kernel's boot id, or ``node_ranks=``) commit in their machine's tier, and each machine drains
its ranks; the drain that brings the last machine's ranks commits the step on the store.
``StorageReader`` loads the newest step of the store or of every machine's tier (a step
that the tiers alone hold, left by a killed job, is drained first), each chunk from the
machine's tier first.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import socket
import threading
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import Metadata
from torch.distributed.checkpoint import StorageReader as _DcpStorageReader
from torch.distributed.checkpoint import StorageWriter as _DcpStorageWriter
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ckpt._native import CkptError, Store, resume_env

__all__ = ["StorageWriter", "StorageReader", "METADATA_BLOB"]

# A load plan's tensors are read in batches of about this many bytes, all their chunks in
# flight together: enough to keep the disk's queue full across many small items, while a
# planner's temporaries (resolved, not yet committed) stay bounded.
_READ_BATCH_BYTES = 512 << 20

#: The blob of the coordinator's rank that holds DCP's pickled ``Metadata``.
METADATA_BLOB = "dcp.metadata"

_TO_CKPT = {
    torch.float64: "f64",
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "bool",
}
for _name, _ck in (
    ("float8_e4m3fn", "f8_e4m3"),
    ("float8_e5m2", "f8_e5m2"),
    ("uint16", "u16"),
    ("uint32", "u32"),
    ("uint64", "u64"),
):
    if hasattr(torch, _name):
        _TO_CKPT[getattr(torch, _name)] = _ck
_FROM_CKPT = {v: k for k, v in _TO_CKPT.items()}


def _ckpt_dtype(t: torch.Tensor, fqn: str) -> str:
    try:
        return _TO_CKPT[t.dtype]
    except KeyError:
        raise CkptError(
            f"tensor {fqn!r}: dtype {t.dtype} has no ckpt type "
            f"(supported: {', '.join(str(d) for d in _TO_CKPT)})"
        ) from None


def _bytes_view(t: torch.Tensor):
    """The bytes of a contiguous CPU tensor as a numpy uint8 array sharing its memory (the
    buffer protocol; bf16 and float8 included, which numpy cannot name)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _store(store: Union[str, Store]) -> Store:
    return store if isinstance(store, Store) else Store(str(store))


def _local_tier(
    local_tier: Union[str, Store, None], run: str, node_ranks: Optional[Sequence[int]]
) -> Tuple[Optional[Store], Optional[List[int]]]:
    """The local tier given, else the one ``ckpt resume --local-tier`` launched this process
    with (for ``run``), else None; and the ranks of this machine when each machine has its
    own tier (given, else ``ckpt agent --local-tier``'s), else None."""
    if local_tier is None:
        env = resume_env()
        if env is not None and env.run == run:
            local_tier = env.local_tier
            if local_tier is not None and node_ranks is None:
                node_ranks = env.local_tier_ranks
    if local_tier is None:
        if node_ranks is not None:
            raise CkptError(
                f"node_ranks {list(node_ranks)} names the ranks of a machine that commit in its "
                "own local tier, but no local tier is set: pass local_tier=, or leave "
                "node_ranks out"
            )
        return None, None
    return _store(local_tier), None if node_ranks is None else sorted({int(r) for r in node_ranks})


def _node_of(machines: List[Any]) -> Optional[List[List[int]]]:
    """Each rank's machine's ranks, where the ranks (in order, by the machine each said it runs
    on) span more than one machine; None on one machine."""
    ranks: Dict[Any, List[int]] = {}
    for r, m in enumerate(machines):
        ranks.setdefault(m, []).append(r)
    if len(ranks) < 2:
        return None
    # One list per machine, shared by its ranks: linear in the world, as every plan is.
    return [ranks[m] for m in machines]


def _nodes_found(group: Any = None) -> Optional[List[List[int]]]:
    """Each rank's machine's ranks (as ``_node_of``), from the machine every rank of ``group``
    says it runs on, gathered: every rank of ``group`` calls it. None on one machine."""
    machines: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(machines, _machine(), group=group)
    return _node_of(machines)


def _ckpt_error(message: str, kind: Optional[str]) -> CkptError:
    """A ``CkptError`` of ``kind``, as ckpt's own errors carry one."""
    err = CkptError(message)
    err.kind = kind
    return err


def _node_step(
    store: Store,
    local: Store,
    run: str,
    node: List[int],
    rate: Optional[float],
    timeout: Optional[float] = None,
    group: Any = None,
) -> Optional[int]:
    """A load without a step by a job whose machines each have their own tier, called by every
    rank: the step to load, the same on every rank. The newest step committed on the store or
    committed on every machine's tier (a node commit on each). A step that only the machines'
    tiers hold (a killed job saved it and did not drain it) is first drained by each machine's
    first rank, the last drain committing it on the store (a step is whole only there); if a
    drain fails (its first failure, or ``timeout`` seconds of tries), the load takes the
    store's newest step and a warning says why (the drain goes on trying behind). None when
    nothing is committed anywhere. ``group``: the process group of the job's ranks to agree in
    (the default one)."""
    rank = dist.get_rank()
    mine: Dict[str, Any] = {"node": min(node), "steps": None, "latest": None, "error": None}
    try:
        if rank == min(node):
            mine["steps"] = local.node_committed_steps(run)
        if rank == 0:
            mine["latest"] = store.latest_committed(run)
    except Exception as e:  # every rank must reach the gather, to fail alike
        mine["error"] = (f"{e}", getattr(e, "kind", None))
    everyone: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine, group=group)
    for r, e in enumerate(everyone):
        if e["error"] is not None:
            message, kind = e["error"]
            # Every rank fails alike.
            raise _ckpt_error(f"choosing the step to load, rank {r}: {message}", kind)
    latest = everyone[0]["latest"]
    tiers = [set(e["steps"]) for e in everyone if e["steps"] is not None]
    on_every_tier = set.intersection(*tiers) if tiers else set()
    newer = [s for s in on_every_tier if latest is None or s > latest]
    if not newer:
        return latest
    wanted = max(newer)
    outcome: Dict[str, Any] = {"committed": False, "error": None}
    if rank == min(node):
        try:
            d = _Drainer.of(local, store, run, node=rank)
            d.submit(wanted, None, None, rate)
            out = d.wait(wanted, timeout)
            if "skipped_for" in out:
                raise CkptError(f"its drain was superseded by step {out['skipped_for']}'s")
            outcome["committed"] = bool(out.get("remote_committed"))
        except Exception as e:  # every rank must reach the gather
            outcome["error"] = f"{e}"
    outcomes: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, outcome, group=group)
    failed = [(r, o["error"]) for r, o in enumerate(outcomes) if o["error"] is not None]
    if not failed and any(o["committed"] for o in outcomes):
        return wanted
    why = (
        f"rank {failed[0][0]}'s drain failed: {failed[0][1]}"
        if failed
        else "the drains did not commit it on the store"
    )
    if rank == 0:
        warnings.warn(
            f"run {run!r}: step {wanted} is committed in every machine's tier but not on "
            f"{store.url}, and bringing it there failed ({why}); loading step {latest}, the "
            "store's newest",
            RuntimeWarning,
            stacklevel=3,
        )
    return latest


def _dist_rank_world(kwargs: dict) -> "tuple[int, int]":
    if dist.is_available() and dist.is_initialized():
        return int(kwargs.get("rank", dist.get_rank())), dist.get_world_size()
    return 0, 1


class StorageWriter(_DcpStorageWriter):
    """Save step ``step`` of run ``run`` into the ckpt store ``store`` (a path or a URL as the
    ``ckpt`` CLI takes it, or a ``ckpt.Store``).

    The step is written under ``generation``: by default the one ``ckpt resume`` launched
    this process in (``ckpt.resume_env()``), so a rank of a generation the supervisor has
    replaced is fenced; without a driver, the newest started generation of the run.

    ``local_tier``: write and commit the step in this local tier (a directory or a
    ``ckpt.Store``), then drain it to ``store`` behind the training (see the module docs);
    ``drain="wait"`` drains within ``finish`` instead; the tier keeps its newest
    ``keep_local`` steps; ``drain_rate`` (stored bytes a second) caps the drain's speed.

    A job of several machines, each with its own local tier (the same path on each machine's
    disk, or ``ckpt agent --local-tier``): each machine's ranks commit in its tier (a node
    commit, by the machine's first rank, the coordinator on its machine), and each machine
    drains its ranks; the drain that brings the last machine's ranks commits the step on the
    store. The machines are told apart by their kernel's boot id; ``node_ranks`` (this
    machine's ranks) says it instead."""

    def __init__(
        self,
        store: Union[str, Store],
        run: str,
        step: int,
        generation: Optional[int] = None,
        local_tier: Union[str, Store, None] = None,
        keep_local: int = 2,
        drain: str = "background",
        drain_rate: Optional[float] = None,
        node_ranks: Optional[Sequence[int]] = None,
    ) -> None:
        super().__init__()
        if drain not in ("background", "wait"):
            raise CkptError(f"drain must be 'background' or 'wait', not {drain!r}")
        if drain_rate is not None and not float(drain_rate) > 0:
            raise CkptError(
                f"drain_rate must be a positive number of bytes a second, not {drain_rate!r}"
            )
        self._drain_rate = None if drain_rate is None else float(drain_rate)
        if int(keep_local) < 1:
            raise CkptError("keep_local must keep at least 1 step in the local tier")
        self._local_arg = local_tier
        self._local: Optional[Store] = None
        self._node_arg = None if node_ranks is None else [int(r) for r in node_ranks]
        if node_ranks is not None:
            _local_tier(local_tier, run, node_ranks)  # refuses node_ranks without a tier
        #: This machine's ranks, when each machine of the job has its own local tier.
        self._node: Optional[List[int]] = None
        #: The rank that commits this machine's ranks: the coordinator on its machine, else
        #: the machine's first rank.
        self._node_committer: Optional[int] = None
        self._keep_local = int(keep_local)
        self._drain_mode = drain
        self._drainer: Optional[_Drainer] = None
        self._store_arg = store
        self.run = run
        self.step = int(step)
        self._store: Optional[Store] = None
        self._writer = None
        self.is_coordinator = False
        self.rank, self.world = 0, 1
        if generation is None:
            env = resume_env()
            if env is not None and env.run == run:
                generation = env.generation
        self._generation = None if generation is None else int(generation)
        self.generation = self._generation or 0
        #: What this rank's writes cost (chunks, chunks_skipped, chunks_written, bytes...),
        #: once its manifest is written.
        self.report: Optional[dict] = None

    # -- DCP's StorageWriter -------------------------------------------------------------

    def reset(self, checkpoint_id: Union[str, "os.PathLike[str]", None] = None) -> None:
        if checkpoint_id is not None:
            raise CkptError(
                "ckpt.dcp.StorageWriter takes its store, run and step in its constructor, "
                f"not a checkpoint_id ({checkpoint_id!r})"
            )
        self._writer = None
        self.report = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, "os.PathLike[str]"]) -> bool:
        return False

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank, self.world = _dist_rank_world(kwargs)
        if self._store is None:
            self._store = _store(self._store_arg)
        if self._local is None:
            self._local, self._node = _local_tier(self._local_arg, self.run, self._node_arg)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self._local is None:
            return plan
        # Which machine (and tier) this rank writes on: the coordinator groups the ranks.
        return dataclasses.replace(
            plan, storage_data={"machine": _machine(), "node": self._node, "rank": self.rank}
        )

    def prepare_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        # The coordinator decides what every rank must agree on: the world (the ranks of the
        # save's process group, whichever it is) and the generation written under.
        generation = self._generation
        if generation is None:
            generation = self._run_generation()
        shared = {"world": len(plans), "generation": generation}
        if self._local is None:
            return [dataclasses.replace(p, storage_data=shared) for p in plans]
        said = [p.storage_data if isinstance(p.storage_data, dict) else {} for p in plans]
        # Each machine's ranks (as given, else by the machine each rank runs on); with more
        # than one machine, each commits its ranks in its own tier.
        ranks = [d.get("rank", i) for i, d in enumerate(said)]
        found = _node_of([d.get("machine") for d in said])
        nodes = []
        for i, d in enumerate(said):
            node = d.get("node")
            if node is None and found is not None:
                node = sorted(ranks[j] for j in found[i])
            nodes.append(node)
        return [
            dataclasses.replace(
                p,
                storage_data={
                    **shared,
                    "node": node,
                    "committer": None
                    if node is None
                    else (self.rank if self.rank in node else min(node)),
                },
            )
            for p, node in zip(plans, nodes)
        ]

    def _run_generation(self) -> int:
        """The newest generation started for the run: the store's, and with a local tier the
        newer of the tier's and the store's, or the tier's alone while the store does not
        answer (the save goes on locally; the drain is fenced on the store when it is back)."""
        if self._local is None:
            return self._store.generation(self.run)
        here = self._local.generation(self.run)
        try:
            return max(here, self._store.generation(self.run))
        except CkptError as e:
            if getattr(e, "kind", None) in _FINAL_DRAIN_ERRORS:
                raise
            warnings.warn(
                f"run {self.run!r} step {self.step}: the store {self._store.url} did not answer "
                f"({e}); the step is saved in the local tier under its generation {here} and "
                "drains once the store answers",
                RuntimeWarning,
                stacklevel=2,
            )
            return here

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=self._checkpoint_id(), save_id=self._checkpoint_id())

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[List[WriteResult]]:
        if self._store is None:
            self._store = _store(self._store_arg)
        if self._local is None:
            self._local, self._node = _local_tier(self._local_arg, self.run, self._node_arg)
        if isinstance(plan.storage_data, dict) and "world" in plan.storage_data:
            self.world = plan.storage_data["world"]
            self.generation = plan.storage_data["generation"]
            if plan.storage_data.get("node") is not None:
                self._node = list(plan.storage_data["node"])
                self._node_committer = plan.storage_data["committer"]
        if self._node is not None and self.rank not in self._node:
            raise CkptError(
                f"node_ranks {self._node} must list this rank ({self.rank}): the ranks of its "
                "machine"
            )
        if self._node is not None and self._node_committer is None:
            self._node_committer = min(self._node)
        target = self._local if self._local is not None else self._store
        writer = target.rank_writer(
            self.run,
            self.step,
            self.rank,
            self.world,
            self.generation,
            node_first=None if self._node is None else min(self._node),
        )
        tensors, blobs, keep, results = [], [], [], []
        for item in plan.items:
            fqn = item.index.fqn
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                raw = data.getbuffer() if isinstance(data, io.BytesIO) else memoryview(data)
                keep.append(data)
                buf = numpy.frombuffer(raw, dtype=numpy.uint8)  # the same memory
                blobs.append((fqn, buf))
                size = buf.nbytes
                where = {"rank": self.rank, "blob": fqn}
            else:
                t = data.detach()
                if t.device.type != "cpu":
                    t = t.cpu()
                t = t.contiguous()
                keep.append(t)
                chunk = item.tensor_data.chunk
                tensors.append(
                    (
                        fqn,
                        _ckpt_dtype(t, fqn),
                        list(item.tensor_data.size),
                        list(chunk.offsets),
                        list(chunk.sizes),
                        _bytes_view(t),
                    )
                )
                size = t.numel() * t.element_size()
                where = {"rank": self.rank, "tensor": fqn}
            results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=where))
        writer.put(tensors, blobs)
        del keep, tensors, blobs
        if self.is_coordinator:
            # The coordinator's manifest also holds DCP's metadata, which `finish` brings.
            self._writer = writer
        else:
            self.report = writer.finish()
            if self._node is not None and self._node_committer == self.rank:
                # This machine's ranks are all written (or written soon): commit them in its
                # tier and drain them; the coordinator does so for its own machine in finish.
                self._commit_node()
        fut: Future[List[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        storage_md = {}
        for wr_list in results:
            storage_md.update({wr.index: wr.storage_data for wr in wr_list})
        metadata.storage_data = storage_md
        # What ties the metadata to this step stays out of the blob, so saving the same state
        # again stores the same bytes (no new chunk); `read_metadata` puts it back.
        metadata.storage_meta = None
        blob = pickle.dumps(metadata, protocol=4)
        writer = self._writer
        if writer is None:
            raise CkptError(
                f"run {self.run!r} step {self.step}: finish without write_data on the coordinator"
            )
        self._writer = None
        writer.put([], [(METADATA_BLOB, blob)])
        self.report = writer.finish()
        if self._local is None:
            self._store.commit(self.run, self.step, self.generation)
            return
        if self._node is not None:
            self._commit_node()
            if self._drain_mode == "wait":
                self._wait_remote_commit()
            return
        # Local-durable; then remote-durable once the drain commits it on the store. (The
        # process's drainer, when new, looks for a step a killed process left undrained
        # before this one is committed.)
        self._drainer = _Drainer.of(self._local, self._store, self.run)
        self._local.commit(self.run, self.step, self.generation)
        self._drainer.submit(
            self.step, self.generation, self._keep_local, self._drain_rate
        )
        if self._drain_mode == "wait":
            self.wait_drained()

    def _commit_node(self) -> None:
        """One machine of several: commit its ranks in its tier (local-durable on this
        machine), then drain them to the store."""
        self._drainer = _Drainer.of(self._local, self._store, self.run, node=self.rank)
        self._local.commit_node(self.run, self.step, self.generation, self._node)
        self._drainer.submit(self.step, self.generation, self._keep_local, self._drain_rate)
        if self._drain_mode == "wait":
            self.wait_drained()

    def _wait_remote_commit(self, timeout: float = 600.0) -> None:
        """The coordinator of a job of several machines, ``drain="wait"``: wait until the
        last machine's drain committed the step on the store."""
        deadline = time.monotonic() + timeout
        pause = 0.02
        while self.step not in self._store.committed_steps(self.run):
            if time.monotonic() >= deadline:
                raise CkptError(
                    f"run {self.run!r} step {self.step}: this machine's ranks are on "
                    f"{self._store.url}, but the step is not committed there after {timeout:.0f} "
                    "s: another machine's ranks are not drained yet (each machine's job, or "
                    "`ckpt drain --local-tier DIR` there, drains them)"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.2)

    def wait_drained(self, timeout: Optional[float] = None) -> Optional[dict]:
        """With a local tier, on the coordinator: wait until the step is committed on the
        store (remote-durable); the drain's figures (``objects_sent``, ``bytes_sent``,
        ``bytes_present``, ``seconds``), or ``{"step": s, "skipped_for": newer}`` when a newer
        step's drain superseded this one's. A drain that fails for the store's sake is tried
        again behind: with ``timeout``, the wait goes on through the tries and raises
        ``CkptError`` (naming the last failure) when ``timeout`` seconds pass first; without
        it, the first failure is raised (the tries go on). A failure no try mends (fenced by a
        newer job, a damaged local chunk) is raised at once. None without a local tier or on
        other ranks. With a tier per machine, on each machine's committing rank: the drain of
        this machine's ranks, whose ``remote_committed`` says whether the step is committed on
        the store yet (the last machine's drain commits it)."""
        if self._drainer is None:
            return None
        return self._drainer.wait(self.step, timeout)

    def _checkpoint_id(self) -> str:
        return f"{_url(self._store_arg)}::{self.run}@{self.step}"


def _machine() -> str:
    """What identifies this process's page cache: the running kernel's boot id (processes in
    containers of one machine share it, as they share the page cache), else the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def _box(item) -> Tuple[str, Tuple[int, ...], Tuple[int, ...]]:
    """A load item's tensor and box in the saved tensor: (fqn, offsets, sizes)."""
    base = item.storage_index.offset or [0] * len(item.lengths)
    offsets = tuple(int(b) + int(o) for b, o in zip(base, item.storage_offsets))
    return (item.storage_index.fqn, offsets, tuple(int(n) for n in item.lengths))


def _url(store: Union[str, Store]) -> str:
    return store.url if isinstance(store, Store) else str(store)


#: Error kinds a drain does not try again: a newer job owns the run on the store, a local
#: copy is damaged, the step is gone or invalid (the same failure every time).
_FINAL_DRAIN_ERRORS = frozenset({"fenced", "damaged data", "invalid input", "not found"})


class _Drainer:
    """The one drain of a process per local tier, store and run: a thread that drains one
    step at a time, the newest waiting one first (older waiting steps are skipped: the newest
    step's drain supersedes them, and their drain markers go with it). A step a killed process
    left committed in the tier and not on the store is superseded so by the first step this
    one submits, or drained after a load (``resume_left``). A drain that fails for the store's
    sake (down, failing requests) is tried again after a pause that doubles from
    ``first_backoff`` to ``max_backoff`` seconds, unless a newer step comes to supersede it.
    The thread is not a daemon (the interpreter waits for the drain in flight before it
    exits) and ends when nothing waits; once the main thread has ended it tries no more, and
    a step left undrained is named in a ``RuntimeWarning`` with the ``ckpt drain`` command
    that finishes it.

    One machine of several (``node``, the rank that drains the machine's ranks): the tier
    holds node commits, each drain brings this machine's ranks, and before its newest step a
    machine drains an older one another machine already drained (it *follows*), so machines
    that skip steps by their own timing still bring the store whole steps."""

    _all: Dict[Tuple[str, str, str, Optional[int]], "_Drainer"] = {}
    _all_lock = threading.Lock()
    first_backoff = 1.0
    max_backoff = 30.0
    kept_outcomes = 256

    @classmethod
    def of(cls, local: Store, store: Store, run: str, node: Optional[int] = None) -> "_Drainer":
        key = (local.url, store.url, run, node)
        with cls._all_lock:
            d = cls._all.get(key)
            if d is None:
                d = cls._all[key] = _Drainer(local, store, run, node)
            return d

    def __init__(self, local: Store, store: Store, run: str, node: Optional[int] = None) -> None:
        self._local, self._store, self._run = local, store, run
        self._node = node
        #: The newest step this drainer drained.
        self._drained: Optional[int] = None
        self._cond = threading.Condition()
        #: The step waiting for the drain: (step, generation, keep_local, rate).
        self._waiting: Optional[Tuple[int, Optional[int], Optional[int], Optional[float]]] = None
        #: Each step's outcome: its figures, a skip, or the drain's final error.
        self._done: Dict[int, Union[dict, BaseException]] = {}
        #: The newest step whose outcome was dropped (``_settle``).
        self._forgotten = -1
        #: The step being drained now.
        self._inflight: Optional[int] = None
        #: A step whose drain failed and waits to be tried again: the last error.
        self._failed: Dict[int, BaseException] = {}
        self._thread: Optional[threading.Thread] = None
        # The tier's newest step if the store lacks it: left undrained by a killed process
        # (unknown while the store does not answer: the next drain supersedes it all the same).
        self._left: Optional[int] = None
        try:
            local_steps = (
                local.committed_steps(run) if node is None else local.node_committed_steps(run)
            )
            remote_steps = store.committed_steps(run)
        except CkptError:
            local_steps, remote_steps = [], []
        if local_steps and (not remote_steps or local_steps[-1] > remote_steps[-1]):
            self._left = local_steps[-1]

    def submit(
        self, step: int, generation: Optional[int], keep_local: Optional[int], rate: Optional[float]
    ) -> None:
        with self._cond:
            self._done.pop(step, None)
            left, self._left = self._left, None
            if left is not None and left < step:
                self._skip(left, step)
            old = self._waiting
            if old is not None and old[0] != step:
                if old[0] > step:
                    # A newer step waits already: this one is superseded at once.
                    self._skip(step, old[0])
                    return
                self._skip(old[0], step)
            self._waiting = (step, generation, keep_local, rate)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._loop, name=f"ckpt-drain-{self._run}"
                )
                self._thread.start()
            self._cond.notify_all()

    def resume_left(self, rate: Optional[float]) -> Optional[int]:
        """Drain the step a killed process left local only, if any and nothing newer was
        submitted (a load's end: the step becomes remote-durable before the first save)."""
        with self._cond:
            left = self._left
            if left is None or self._waiting is not None:
                return None
        self.submit(left, None, None, rate)
        return left

    def _skip(self, step: int, newer: int) -> None:
        warnings.warn(
            f"run {self._run!r}: the drain to {self._store.url} is behind; step {step} is "
            f"skipped for step {newer} (it stays local-durable until step {newer} is remote)",
            RuntimeWarning,
            stacklevel=4,
        )
        self._failed.pop(step, None)
        self._settle(step, {"step": step, "skipped_for": newer})
        self._cond.notify_all()

    def _loop(self) -> None:
        backoff = self.first_backoff
        while True:
            with self._cond:
                if self._waiting is None:
                    self._thread = None
                    return
                job = self._waiting
                self._waiting = None
                self._inflight = job[0]
            step, generation, keep_local, rate = job
            older = self._follow(step, generation)
            if older is not None:
                # The newest waits again, behind the step another machine drained.
                with self._cond:
                    if self._waiting is None:
                        self._waiting = job
                    elif self._waiting[0] > step:
                        self._skip(step, self._waiting[0])
                    self._inflight = older
                job = (older, generation, keep_local, rate)
                step = older
            try:
                out: Union[dict, BaseException] = self._local.drain_to(
                    self._store,
                    self._run,
                    step,
                    generation=generation,
                    keep_local=keep_local,
                    rate=rate,
                    node=self._node,
                )
                backoff = self.first_backoff
                self._drained = step if self._drained is None else max(self._drained, step)
            except BaseException as e:  # reported by wait
                out = e
            if older is not None and not isinstance(out, dict):
                # A followed step failed: the newest (waiting again) is tried after a pause,
                # and follows it again then if the store still needs it.
                with self._cond:
                    self._inflight = None
                    self._settle(step, out)
                    deadline = time.monotonic() + backoff
                    while threading.main_thread().is_alive() and time.monotonic() < deadline:
                        self._cond.wait(min(0.2, max(0.0, deadline - time.monotonic())))
                    if not threading.main_thread().is_alive():
                        # The process is exiting: no more tries.
                        newest, self._waiting = self._waiting, None
                        if newest is not None:
                            self._settle(newest[0], out)
                            self._undrained_at_exit(newest[0], out)
                        self._cond.notify_all()
                backoff = min(backoff * 2, self.max_backoff)
                continue
            with self._cond:
                self._inflight = None
                verdict = "done" if isinstance(out, dict) else self._after_failure(job, out)
                if verdict == "superseded":
                    continue  # its outcome is the skip
                if verdict == "done":
                    self._failed.pop(step, None)
                    self._settle(step, out)
                    self._cond.notify_all()
                    continue
                # A pause, cut short by a newer step (which supersedes this one) or by the
                # end of the main thread (the process is exiting: no more tries).
                deadline = time.monotonic() + backoff
                while (
                    self._waiting is job
                    and threading.main_thread().is_alive()
                    and time.monotonic() < deadline
                ):
                    self._cond.wait(min(0.2, max(0.0, deadline - time.monotonic())))
                backoff = min(backoff * 2, self.max_backoff)
                if self._waiting is job and not threading.main_thread().is_alive():
                    self._waiting = None
                    self._failed.pop(step, None)
                    self._settle(step, out)
                    self._cond.notify_all()
                    self._undrained_at_exit(step, out)

    def _follow(self, newest: int, generation: Optional[int]) -> Optional[int]:
        """One machine of several: the older step to drain before ``newest`` (see the class
        docs), if any."""
        if self._node is None or generation is None:
            return None
        try:
            older = self._local.step_to_follow(
                self._store, self._run, newest, self._node, generation, drained=self._drained
            )
        except CkptError:
            return None  # the store does not answer: the drain's own tries say so
        if older is not None:
            warnings.warn(
                f"run {self._run!r}: another machine drained step {older} to "
                f"{self._store.url}; this machine drains its ranks of it before step {newest}",
                RuntimeWarning,
                stacklevel=2,
            )
        return older

    def _pending(self, step: int) -> bool:
        """Whether `step` waits for its drain, is being drained, or is to be tried again."""
        waiting = self._waiting is not None and self._waiting[0] == step
        return waiting or self._inflight == step or step in self._failed

    def _settle(self, step: int, out: Union[dict, BaseException]) -> None:
        """Keep `step`'s outcome for ``wait``: of the newest ``kept_outcomes`` steps only (a
        job saving for weeks does not keep one per save)."""
        self._done[step] = out
        while len(self._done) > self.kept_outcomes:
            old = next(iter(self._done))
            del self._done[old]
            self._forgotten = max(self._forgotten, old)

    def _after_failure(self, job: tuple, out: BaseException) -> str:
        """What follows a failed drain: ``"retry"`` (it waits again, the error kept for
        ``wait``), ``"superseded"`` (a newer step waits: skipped for it) or ``"done"`` (the
        error is the outcome: a failure no retry mends, or the process is exiting)."""
        step = job[0]
        if not isinstance(out, CkptError) or getattr(out, "kind", None) in _FINAL_DRAIN_ERRORS:
            return "done"
        if not threading.main_thread().is_alive():
            self._undrained_at_exit(step, out)
            return "done"
        if self._waiting is not None and self._waiting[0] > step:
            self._skip(step, self._waiting[0])
            return "superseded"
        if self._waiting is None:
            self._waiting = job
        self._failed[step] = out
        self._cond.notify_all()
        warnings.warn(
            f"run {self._run!r}: draining step {step} to {self._store.url} failed "
            f"(tried again in a while; the step is local-durable): {out}",
            RuntimeWarning,
            stacklevel=2,
        )
        return "retry"

    def _undrained_at_exit(self, step: int, error: BaseException) -> None:
        warnings.warn(
            f"run {self._run!r}: step {step} is committed in the local tier "
            f"{self._local.url} but not on {self._store.url}, and the process is exiting "
            f"(the last drain failed: {error}); `ckpt --store {self._store.url} drain "
            f"--local-tier {self._local.url} {self._run}` finishes it, as does the run's "
            "next save",
            RuntimeWarning,
            stacklevel=2,
        )

    def wait(self, step: int, timeout: Optional[float]) -> dict:
        with self._cond:

            def settled() -> bool:
                return (
                    step in self._done
                    or (timeout is None and step in self._failed)
                    or (step <= self._forgotten and not self._pending(step))
                )

            if not self._cond.wait_for(settled, timeout):
                last = self._failed.get(step)
                raise CkptError(
                    f"run {self._run!r} step {step}: still draining to "
                    f"{self._store.url} after {timeout} s (it is local-durable)"
                    + ("" if last is None else f"; the last try failed: {last}")
                )
            out = self._done.get(step, self._failed.get(step))
            if out is None:
                raise CkptError(
                    f"run {self._run!r} step {step}: its drain ended long ago and its outcome "
                    f"is no longer kept (the newest {self.kept_outcomes} steps' are); "
                    "`ckpt ls --local-tier` shows where it is durable"
                )
        if isinstance(out, BaseException):
            raise out
        return out


class StorageReader(_DcpStorageReader):
    """Load step ``step`` of run ``run`` from the ckpt store ``store``; without ``step``, the
    newest committed step (all ranks agree on it: rank 0 of the default process group chooses
    and broadcasts it, so pass ``step`` when loading with ``no_dist`` or a subgroup). An
    uncommitted step is never read: opening one fails with ``CkptError`` (kind ``not found``).

    ``local_tier``: the newest step of the tier and the store; a step committed in the tier
    is read there, each chunk missing or damaged there from the store. After the load, the
    coordinator drains to the store a newest step a killed process left in the tier only
    (behind the training, as the writer's drain: ``drain_rate`` caps it).

    A tier per machine (``node_ranks``, ``ckpt agent --local-tier``, or ranks of several
    machines, told apart by the kernel's boot id, given one ``local_tier`` path): the step is
    read from the store (a step is whole only there), each chunk from this machine's tier
    first, hash-checked, and from the store where the tier lacks it or holds it damaged.
    Without ``step``, the newest step committed on the store or on every machine's tier: a
    step a killed job committed in the tiers and did not drain is drained first (each
    machine's first rank its ranks, the last drain committing it on the store), so no saved
    step is lost to a restart; if that drain fails, the store's newest step is loaded and a
    ``RuntimeWarning`` says why."""

    def __init__(
        self,
        store: Union[str, Store],
        run: str,
        step: Optional[int] = None,
        local_tier: Union[str, Store, None] = None,
        drain_rate: Optional[float] = None,
        node_ranks: Optional[Sequence[int]] = None,
    ) -> None:
        super().__init__()
        if drain_rate is not None and not float(drain_rate) > 0:
            raise CkptError(
                f"drain_rate must be a positive number of bytes a second, not {drain_rate!r}"
            )
        self._drain_rate = None if drain_rate is None else float(drain_rate)
        self._local_arg = local_tier
        self._local: Optional[Store] = None
        self._node_arg = None if node_ranks is None else [int(r) for r in node_ranks]
        if node_ranks is not None:
            _local_tier(local_tier, run, node_ranks)  # refuses node_ranks without a tier
        self._node: Optional[List[int]] = None
        self._store_arg = store
        self.run = run
        self.step = None if step is None else int(step)
        self.rank = 0
        self._store: Optional[Store] = None
        self._reader = None
        self._dtypes: dict = {}
        self.storage_data: dict = {}
        self.is_coordinator = False

    def reset(self, checkpoint_id: Union[str, "os.PathLike[str]", None] = None) -> None:
        if checkpoint_id is not None:
            raise CkptError(
                "ckpt.dcp.StorageReader takes its store, run and step in its constructor, "
                f"not a checkpoint_id ({checkpoint_id!r})"
            )
        self.storage_data = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, "os.PathLike[str]"]) -> bool:
        return False

    def _open(self):
        if self._reader is not None:
            return self._reader
        if self._store is None:
            self._store = _store(self._store_arg)
        if self._local is None:
            self._local, self._node = _local_tier(self._local_arg, self.run, self._node_arg)
        step = self.step
        # Only a load without `step` is collective (every rank opens it, as documented).
        collective = (
            step is None
            and dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size() > 1
        )
        if collective and self._local is not None and self._node is None:
            # A tier given to the ranks of several machines is each machine's own, as the
            # writer takes it: each machine's ranks read their machine's tier first.
            found_nodes = _nodes_found()
            if found_nodes is not None:
                self._node = found_nodes[dist.get_rank()]
        if self._node is not None and collective:
            step = _node_step(self._store, self._local, self.run, self._node, self._drain_rate)
        if step is None:
            found, error = None, None
            if not collective or dist.get_rank() == 0:
                try:
                    found = self._store.latest_committed(self.run)
                    if self._local is not None and self._node is None:
                        here = self._local.latest_committed(self.run)
                        if here is not None and (found is None or here > found):
                            found = here
                except CkptError as e:
                    error = str(e)
            if collective:
                # Every rank loads the step rank 0 found, even if one is committed meanwhile
                # (and every rank fails alike when it found none).
                chosen = [(found, error)]
                dist.broadcast_object_list(chosen, src=0)
                found, error = chosen[0]
            if error is not None:
                raise CkptError(error)
            if found is None:
                raise CkptError(f"run {self.run!r} has no committed step")
            step = found
        try:
            if self._node is not None:
                self._reader = self._store.open_step(self.run, step, source=self._local)
            elif self._local is not None and step in self._local.committed_steps(self.run):
                self._reader = self._local.open_step(self.run, step, fallback=self._store)
            else:
                self._reader = self._store.open_step(self.run, step)
        except CkptError as e:
            if getattr(e, "kind", None) != "not found" or self._local is None:
                raise
            if step not in self._local.node_committed_steps(self.run):
                raise
            # This machine committed its ranks of the step, and the store lacks it whole.
            raise _ckpt_error(
                f"{e}; this machine's tier {self._local.url} holds its ranks of step {step} "
                "(a node commit), not drained: a load without step= drains such a step on "
                f"every machine first, as does `ckpt --store {self._store.url} drain "
                f"--local-tier DIR {self.run}` run on each machine",
                "not found",
            ) from e
        self._dtypes = {name: dt for name, dt, _ in self._reader.tensors()}
        return self._reader

    def read_metadata(self) -> Metadata:
        reader = self._open()
        holders = [r for r, name, _ in reader.blobs() if name == METADATA_BLOB]
        if holders:
            metadata = pickle.loads(reader.read_blob(holders[0], METADATA_BLOB))
        else:
            metadata = self._metadata_of_tensors(reader)
        metadata.storage_meta = StorageMeta(
            checkpoint_id=f"{_url(self._store_arg)}::{self.run}@{reader.step}",
            save_id=f"{_url(self._store_arg)}::{self.run}@{reader.step}",
        )
        return metadata

    def _metadata_of_tensors(self, reader) -> Metadata:
        """The metadata of a step not saved through DCP (``ckpt import``, the Rust
        ``CheckpointManager``): every tensor as one chunk of its whole shape (ckpt reads any
        box of it), named as saved; its blobs are not DCP items."""
        md = {}
        for name, dt, shape in reader.tensors():
            if dt not in _FROM_CKPT:
                raise CkptError(
                    f"step {reader.step} of run {self.run!r}: tensor {name!r} is {dt}, "
                    "which torch has no type for"
                )
            md[name] = TensorStorageMetadata(
                properties=TensorProperties(dtype=_FROM_CKPT[dt]),
                size=torch.Size(shape),
                chunks=[
                    ChunkStorageMetadata(
                        offsets=torch.Size([0] * len(shape)), sizes=torch.Size(shape)
                    )
                ],
            )
        return Metadata(state_dict_metadata=md, storage_data={})

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.storage_data = metadata.storage_data
        self.is_coordinator = is_coordinator
        self.rank = _dist_rank_world(kwargs)[0]

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # Which page cache this rank reads through: the coordinator shares reads only among
        # the ranks of one machine.
        return dataclasses.replace(plan, storage_data={"machine": _machine()})

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        # The boxes more than one rank of a machine reads alike (data-parallel replicas,
        # which every rank loads whole): those ranks read them through the page cache, so the
        # machine's disk serves them once, where reads around it (O_DIRECT) would go to the
        # disk per rank. A box no other rank of its machine reads goes around it: the page
        # cache would only cost that rank (a cold restore of a rank alone on its machine took
        # 1.7-2.3x the read through it, 1.0-1.1x around it).
        readers: Dict[Tuple[Any, Tuple[str, Tuple[int, ...], Tuple[int, ...]]], int] = {}
        boxes = [{_box(i) for i in p.items if i.type != LoadItemType.BYTE_IO} for p in plans]
        machines = [
            p.storage_data.get("machine") if isinstance(p.storage_data, dict) else None
            for p in plans
        ]
        for machine, mine in zip(machines, boxes):
            for b in mine:
                readers[(machine, b)] = readers.get((machine, b), 0) + 1
        return [
            dataclasses.replace(
                p,
                storage_data={"shared": sorted(b for b in mine if readers[(machine, b)] > 1)},
            )
            for p, machine, mine in zip(plans, machines, boxes)
        ]

    @property
    def checkpoint_step(self) -> Optional[int]:
        """The step read (known once the metadata was read)."""
        return None if self._reader is None else self._reader.step

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read the plan's items: blobs one by one, tensors in batches of about
        ``_READ_BATCH_BYTES`` whose chunks are all in flight at once (``read_many``), each
        written straight into its target when the target is a contiguous CPU tensor of the
        saved dtype (else into a temporary, copied after)."""
        reader = self._open()
        # Boxes other ranks of this machine read too go in batches of their own, read through
        # the page cache (see prepare_global_plan).
        shared = set()
        if isinstance(plan.storage_data, dict):
            shared = {(f, tuple(o), tuple(n)) for f, o, n in plan.storage_data.get("shared", ())}
        batches: Dict[bool, list] = {False: [], True: []}
        batch_bytes = {False: 0, True: 0}

        def flush(kind: bool) -> None:
            batch = batches[kind]
            batch_bytes[kind] = 0
            if not batch:
                return
            reader.read_many(
                [(name, offs, sizes, _bytes_view(buf)) for _, _, name, offs, sizes, buf in batch],
                shared=kind,
            )
            for req, target, _, _, _, buf in batch:
                if buf is not target:
                    target.copy_(buf)
                planner.commit_tensor(req, target)
            batch.clear()

        for req in plan.items:
            where = self.storage_data.get(req.storage_index)
            if req.type == LoadItemType.BYTE_IO:
                if where is None or "blob" not in where:
                    raise CkptError(
                        f"step {reader.step} of run {self.run!r}: no blob for "
                        f"{req.storage_index.fqn!r} in its metadata"
                    )
                data = reader.read_blob(where["rank"], where["blob"])
                planner.load_bytes(req, io.BytesIO(data))
                continue
            box = _box(req)
            fqn, offsets, sizes = box[0], list(box[1]), list(box[2])
            name = where["tensor"] if where and "tensor" in where else fqn
            try:
                dtype = _FROM_CKPT[self._dtypes[name]]
            except KeyError:
                raise CkptError(
                    f"step {reader.step} of run {self.run!r}: no tensor {name!r} "
                    f"of a type torch knows"
                ) from None
            target = planner.resolve_tensor(req).detach()
            if list(target.size()) != sizes:
                raise CkptError(
                    f"tensor {name!r}: the planner's target has shape {list(target.size())}, "
                    f"the region read {sizes}"
                )
            if target.device.type == "cpu" and target.dtype == dtype and target.is_contiguous():
                buf = target
            else:
                buf = torch.empty(sizes, dtype=dtype)
            kind = box in shared
            batches[kind].append((req, target, name, offsets, sizes, buf))
            batch_bytes[kind] += buf.numel() * buf.element_size()
            if batch_bytes[kind] >= _READ_BATCH_BYTES:
                flush(kind)
        flush(False)
        flush(True)
        if self._node is not None:
            if self.rank == min(self._node):
                _Drainer.of(self._local, self._store, self.run, node=self.rank).resume_left(
                    self._drain_rate
                )
        elif self._local is not None and self.is_coordinator:
            # A step a killed process left in the tier and not on the store drains behind
            # the training from now on (the first save supersedes it if it comes first).
            _Drainer.of(self._local, self._store, self.run).resume_left(self._drain_rate)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut
