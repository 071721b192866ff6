"""``ckpt.CheckpointManager``: ckpt's own asynchronous checkpointing for a PyTorch loop.

::

    mgr = ckpt.CheckpointManager("/data/ckpts", run="llama", every_steps=100, keep_last=3)
    step = mgr.restore_latest(state_dict)     # None when there is nothing to restore
    for step in range(0 if step is None else step + 1, steps):
        ...
        mgr.maybe_save(step, state_dict)      # returns once the snapshot is taken
        if mgr.should_stop:                   # SIGTERM: the final checkpoint is committed
            break
    mgr.finish()

It is the Rust ``CheckpointManager`` underneath (``ckpt._native.Manager``): the interval
policy, the staging pool and snapshot, the background persist (chunks, blake3, codecs, dedup
against the previous step) with its governor, the commit, retention and the final checkpoint
on SIGTERM. ``maybe_save`` hands the state over only when a checkpoint is due: each tensor's
memory is lent to Rust without a copy (bf16 and float8 included) and copied into staging by
Rust threads with the GIL released; the call returns once that copy is done, so a tensor
changed after it returns never reaches that checkpoint, and the persist goes on in the
background.

The state dict is flattened as ``torch.distributed.checkpoint`` does (``model.0.weight``,
``optim.state.0.weight.exp_avg``): a step saved here is an ordinary ckpt step that
``ckpt.dcp.StorageReader`` loads (its tensors) and ``ckpt export`` writes to safetensors under
those names. A ``DTensor`` (FSDP2, tensor parallel) is saved as what this rank holds
(``to_local()``), with the global shape and the shard's offsets as its box; a replicated
shard (``Replicate()`` mesh dimensions, and plain tensors in a job of several processes, as DCP
treats them) is written by one holder only, the holders' writes balanced by bytes (the largest
tensors first, each to the holder that writes the least so far). Any world size and placement
restores it: every rank reads the boxes it holds now. Values that are not tensors (ints,
floats, strings, dicts, ``BytesIO``) are pickled into one blob written by rank 0 and restored
on every rank, as DCP keeps one copy of them.

Tensors must be on the CPU: a CUDA tensor is refused with an error naming it (move the state
to host memory first, or use ``ckpt.dcp.StorageWriter``, which DCP stages to host itself).
"""

from __future__ import annotations

import heapq
import os
import pickle
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ckpt._native import CkptError, Manager, Store, resume_env
from ckpt.dcp import _bytes_view, _ckpt_dtype, _store

try:  # DCP's own flattening, so names match what DCP saves and loads
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict as _flatten
    from torch.distributed.checkpoint._traverse import set_element as _set_element
except ImportError:  # pragma: no cover - every torch with DTensor has them
    _flatten = None
    _set_element = None

try:
    from torch.distributed.tensor import DTensor, Partial, Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # pragma: no cover - torch without DTensor
    DTensor = Partial = Replicate = None
    compute_local_shape_and_global_offset = None

__all__ = ["CheckpointManager"]


def _flat(state_dict: dict) -> "Tuple[dict, dict]":
    if _flatten is None:
        raise CkptError("this torch has no torch.distributed.checkpoint: cannot flatten a state dict")
    return _flatten(state_dict)


def _node_processes(given: Optional[int]) -> Optional[int]:
    """``given``, else the launcher's count of this machine's rank processes, if it set one."""
    if given is not None:
        if int(given) < 1:
            raise CkptError(f"node_processes must be at least 1, not {given}")
        return int(given)
    try:
        n = int(os.environ.get("LOCAL_WORLD_SIZE", ""))
    except ValueError:
        return None
    return n if n >= 1 else None


def _balanced_writers(sizes: "List[Tuple[str, int]]", world: int) -> Dict[str, int]:
    """The rank that writes each tensor every rank holds whole (DDP's state), as the Rust
    placement picks the writers of replicated tensors: largest first (then by name), each to
    the rank that writes the fewest bytes so far (the lowest among equals). Every rank holds
    the same tensors, so every rank computes the same writers; no rank writes much more than
    another, which on a machine of its own sets its time to durable."""
    heap = [(0, r) for r in range(world)]
    out: Dict[str, int] = {}
    for fqn, n in sorted(sizes, key=lambda x: (-x[1], x[0])):
        load, r = heapq.heappop(heap)
        out[fqn] = r
        heapq.heappush(heap, (load + n, r))
    return out


def _replicate_coords(flat: dict) -> "Dict[Tuple[str, int], int]":
    """The coordinate along each ``Replicate()`` mesh dimension of a DTensor at which its
    holders' writer sits, keyed by (name, dimension): the DTensors replicated along the same
    dimension of the same mesh balanced over that dimension by their local bytes, as
    ``_balanced_writers`` balances plain tensors. The ranks along such a dimension hold the same
    shards of every DTensor (they differ only where the DTensors are replicated), so they
    compute the same coordinates."""
    groups: Dict[tuple, List[Tuple[str, int]]] = {}
    # A mesh by its ranks (meshes built apart over the same ranks are one), listed once each.
    mesh_keys: Dict[int, tuple] = {}
    for fqn, v in flat.items():
        if DTensor is None or not isinstance(v, DTensor):
            continue
        mesh = v.device_mesh
        local = v.to_local()
        n = local.numel() * local.element_size()
        key = mesh_keys.get(id(mesh))
        if key is None:
            key = (tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape))
            mesh_keys[id(mesh)] = key
        for d, p in enumerate(v.placements):
            if isinstance(p, Replicate):
                groups.setdefault((key, d), []).append((fqn, n))
    out: Dict[Tuple[str, int], int] = {}
    for ((_, shape), d), items in groups.items():
        for fqn, c in _balanced_writers(items, shape[d]).items():
            out[(fqn, d)] = c
    return out


class CheckpointManager:
    """One rank's checkpoints of run ``run`` in the store ``store`` (a path or URL as the
    ``ckpt`` CLI takes it, or a ``ckpt.Store``); see the module docs.

    ``every_steps`` / ``every_seconds``: the interval policy (a checkpoint when ``step`` is a
    multiple of ``every_steps``, or when that much time passed since the last one).
    ``keep_last`` / ``keep_every``: retention (keep the newest N committed steps, and the
    multiples of K), run by rank 0 in the background. ``final_on_sigterm``: on SIGTERM the
    next ``maybe_save`` takes a final checkpoint, waits for its commit and sets
    ``should_stop``; in a job of several processes the ranks agree on it (one tiny gloo
    all-reduce per ``maybe_save``), so the final checkpoint is one step on every rank even when
    only one rank got the signal. ``rank``/``world`` default to the default process group's;
    ``generation`` and the resume step to what ``ckpt resume`` launched this process with.
    ``staging_bytes`` bounds the staging memory (0: as much as one snapshot needs);
    ``governor``: pace the persist when it slows the steps beside it (the Rust manager's
    persist governor).

    The sentinel: every rank holding a replicated tensor (DDP's parameters, ``Replicate()``
    DTensor dimensions) hashes ``sdc_check`` of its own copy at each checkpoint (``"full"``,
    ``"sample=F"``, ``"off"``; default: what ``ckpt resume --sdc-check`` says, else
    ``"sample=0.05"``), and rank 0 compares the hashes with the stored bytes before it
    commits: replicas that differ (silent data corruption on one side) are a
    ``replica_mismatch`` event naming the tensor, chunk, ranks and nodes;
    ``on_replica_mismatch="stop"`` also makes the next call raise. A trainable tensor (one with
    ``requires_grad``, one of the tensors in ``trainable`` (a module's or an iterable's
    parameters, matched by memory), or an optimizer's per-parameter state) whose bytes stay the
    same over ``stale_after`` checkpoints is a ``state_unchanged`` event (0: off).

    The local tier: with ``local_tier`` (a directory on the node's disk, or a store URL;
    default: what ``ckpt resume --local-tier`` says) saves persist and commit there, at the
    local disk's speed, and rank 0 drains each committed step to ``store`` behind the loop
    (only the objects the store lacks, hash-checked on the way, newest first when behind, retried
    after a failure, finished by the next job after a crash). The tier keeps the newest
    ``keep_local`` steps; ``keep_last`` applies to ``store``. ``restore_latest`` reads the
    local tier first and whatever is missing or damaged there from ``store``. ``finish``
    waits until the newest step is in ``store``; ``drains()`` lists the drains' figures. Every
    rank of the job must see the same tier (one machine, or a shared file system), unless
    ``node_ranks`` lists the ranks of this machine (default: what ``ckpt agent --local-tier``
    of a job of several machines says): each machine then has its own tier, its first rank
    commits its ranks there and drains them, and the drain that lands the last machine's
    ranks commits the step on ``store``; ``restore_latest`` restores the store's newest step,
    each chunk from the local tier where it has it.

    ``node_processes``: how many of the job's rank processes run on this machine (default:
    ``LOCAL_WORLD_SIZE``, as torchrun and ``ckpt resume`` set it). The tensors every rank
    restores whole (DDP's parameters) are read through the page cache, so the machine's disk
    serves them once for all its ranks; a rank alone on its machine (1) reads them around it,
    which is faster when no one else will read them.
    """

    def __init__(
        self,
        store: Union[str, Store],
        run: str,
        every_steps: Optional[int] = None,
        every_seconds: Optional[float] = None,
        keep_last: Optional[int] = None,
        keep_every: Optional[int] = None,
        *,
        final_on_sigterm: bool = True,
        rank: Optional[int] = None,
        world: Optional[int] = None,
        generation: Optional[int] = None,
        staging_bytes: int = 0,
        governor: bool = True,
        sdc_check: Optional[str] = None,
        on_replica_mismatch: str = "warn",
        stale_after: int = 2,
        trainable: Any = None,
        local_tier: Union[str, Store, None] = None,
        keep_local: int = 2,
        node_processes: Optional[int] = None,
        node_ranks: Optional[Sequence[int]] = None,
    ) -> None:
        distributed = dist.is_available() and dist.is_initialized()
        if rank is None:
            rank = dist.get_rank() if distributed else 0
        if world is None:
            world = dist.get_world_size() if distributed else 1
        self.run = run
        self.rank, self.world = int(rank), int(world)
        env = resume_env()
        resume_step = None
        node = None
        if env is not None and env.run == run:
            if generation is None:
                generation = env.generation
            resume_step = env.resume_step
            node = env.node
            if sdc_check is None:
                sdc_check = env.sdc_check
            if local_tier is None:
                local_tier = env.local_tier
                if node_ranks is None:
                    node_ranks = env.local_tier_ranks
        if isinstance(trainable, torch.nn.Module):
            trainable = [p for p in trainable.parameters() if p.requires_grad]
        self._trainable_ptrs = {
            t.detach().data_ptr() for t in (trainable or []) if isinstance(t, torch.Tensor)
        }
        # The ranks agree on a SIGTERM, and find which of them share a machine, through a
        # gloo group (CPU tensors whatever the default backend is); created by every rank, as
        # `new_group` must be.
        group = None
        detect = local_tier is not None and node_ranks is None
        if distributed and self.world > 1 and (final_on_sigterm or detect):
            group = dist.new_group(backend="gloo")
        if detect and group is not None:
            # A local tier given to the ranks of several machines is each machine's own: each
            # machine's ranks commit there (a node commit), as `node_ranks=` says.
            import ckpt.dcp

            found = ckpt.dcp._nodes_found(group)
            if found is not None:
                node_ranks = found[self.rank]
        self.store = _store(store)
        self._native = Manager(
            self.store,
            run,
            rank=self.rank,
            world=self.world,
            generation=int(generation or 0),
            every_steps=every_steps,
            every_s=every_seconds,
            keep_last=keep_last,
            keep_every=keep_every,
            final_on_sigterm=final_on_sigterm,
            resume_step=resume_step,
            staging_bytes=int(staging_bytes),
            governor=governor,
            sdc_check=sdc_check,
            on_replica_mismatch=on_replica_mismatch,
            stale_after=int(stale_after),
            node=node,
            local_tier=None if local_tier is None else _store(local_tier),
            keep_local=int(keep_local),
            node_processes=_node_processes(node_processes),
            node_ranks=None if node_ranks is None else [int(r) for r in node_ranks],
        )
        self._group = group if final_on_sigterm else None
        # A tier per machine outside a driver: a restore first agrees on the step, bringing
        # to the store a step every machine committed and none drained (a driver does so
        # itself before it chooses the step to resume from).
        self._node_load = None
        driven = env is not None and env.run == run
        if node_ranks is not None and not driven and distributed and self.world > 1:
            self._node_load = (_store(local_tier), [int(r) for r in node_ranks], group)

    # -- the loop's calls -------------------------------------------------------------------

    def restore_latest(self, state_dict: dict) -> Optional[int]:
        """Restore the step to resume from (the one ``ckpt resume`` chose, else the newest
        committed step) into ``state_dict`` in place, whatever world size and placement saved
        it; returns its number, or None when the run has no committed step (``state_dict`` is
        then untouched). Tensors are written into their memory; other values are replaced.
        ``state_dict`` must hold every tensor to restore, as ``dcp.load`` needs (an optimizer's
        state exists after its first step, or from ``get_state_dict`` of
        ``torch.distributed.checkpoint.state_dict``).

        With a local tier per machine (``node_ranks``, or found) and no driver, the newest step
        is that of the store or of every machine's tier: a step a killed job committed in the
        tiers and did not drain is drained first (each machine's first rank its ranks), as
        ``ckpt.dcp.StorageReader`` does; if that fails, the store's newest step is restored
        and a ``RuntimeWarning`` says why."""
        flat, mapping = _flat(state_dict)
        entries, others, copies = [], [], []
        for fqn, v in flat.items():
            if not isinstance(v, torch.Tensor):
                others.append(fqn)
                continue
            local, shape, offsets, _ = self._box(fqn, v)
            target = local.detach()
            if not (target.is_contiguous() and target.device.type == "cpu"):
                tmp = torch.empty(target.shape, dtype=target.dtype)
                copies.append((target, tmp))
                target = tmp
            entries.append(
                (
                    fqn,
                    _ckpt_dtype(target, fqn),
                    shape,
                    offsets,
                    list(target.shape),
                    _bytes_view(target),
                    None,
                    False,
                )
            )
        step = None
        if self._node_load is not None:
            import ckpt.dcp

            local, node, group = self._node_load
            step = ckpt.dcp._node_step(self.store, local, self.run, node, None, group=group)
            if step is None:
                return None  # nothing committed on the store or every machine's tier
        got = self._native.restore_latest(entries, step)
        if got is None:
            return None
        step, pickled = got
        for dst, tmp in copies:
            dst.copy_(tmp)
        values = pickle.loads(pickled) if pickled else {}
        missing = [k for k in others if k not in values]
        if missing:
            raise CkptError(
                f"step {step} of run {self.run!r} has no value for {', '.join(map(repr, missing))}"
            )
        for fqn in others:
            _set_element(state_dict, mapping[fqn], values[fqn])
        return step

    def maybe_save(self, step: int, state_dict: dict) -> bool:
        """Call once a step, after the optimizer step. Saves ``state_dict`` as ``step`` when the
        interval policy says so (or a final checkpoint after SIGTERM, then ``should_stop``);
        returns once the snapshot is taken (the state may change from then on) while the
        persist goes on in the background. Returns whether a checkpoint was taken.

        At the first call that takes no checkpoint (before any), ``state_dict`` is read once
        more to size the staging pool (a copy of the rank's state kept between saves), which
        then fills on a background thread at the lowest CPU priority: the first checkpoint
        copies into memory already faulted in, as later ones do, unless ``staging_bytes``
        gives the pool a bound (it then fills from the manager's creation)."""
        agreed = None
        if self._group is not None:
            flag = torch.tensor([1 if self._native.sigterm_received else 0], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
            # Every rank follows the agreed flag, not its own: a SIGTERM arriving after the
            # all-reduce waits for the next step, on every rank alike.
            agreed = bool(flag.item())
        keep: List[Any] = []
        return self._native.maybe_save(
            int(step), lambda: self._prepare(state_dict, keep), agreed
        )

    @property
    def should_stop(self) -> bool:
        """Whether SIGTERM (or ``request_stop``) asked the job to stop and the final
        checkpoint was taken: the loop ends."""
        return self._native.should_stop

    def request_stop(self) -> None:
        """Take a final checkpoint at the next ``maybe_save`` and stop, as SIGTERM does."""
        self._native.request_stop()

    def wait(self, timeout_s: float = 600.0) -> Optional[Dict[str, Any]]:
        """Wait until the last checkpoint taken is committed (rank 0; persisted on the others);
        its figures: ``step``, ``stage``, ``bytes``, ``snapshot_s`` (the loop's stall),
        ``persist_s`` (time to durable), ``commit_s``, ``bytes_written``, ``bytes_skipped``."""
        return self._native.wait(timeout_s)

    def staging(self) -> Dict[str, int]:
        """The staging pool's bytes: ``allocated`` (faulted in, kept between saves),
        ``in_use`` (held by the save in flight), ``peak_in_use``, ``capacity`` (its bound)."""
        return self._native.staging()

    def last_report(self) -> Optional[Dict[str, Any]]:
        """The figures of the last checkpoint taken, so far (see ``wait``)."""
        return self._native.last_report()

    def finish(self) -> None:
        """Wait for the checkpoint in flight to commit and for retention; with a local tier,
        until the newest step is drained to the store. Then free the staging memory (a copy
        of the rank's state kept between saves): a job done saving holds its state once, as
        after DCP's ``async_save``. A save after ``finish`` allocates it again (the stall of a
        first save); between saves, ``wait`` waits for the commit and keeps it."""
        self._native.finish()

    def drains(self) -> List[Dict[str, Any]]:
        """With a local tier, on rank 0: the drains to the store that ended since the last
        call, oldest first (``step``, ``objects_sent``, ``bytes_sent``, ``bytes_present``,
        ``seconds``, ``lag_s``, ``lag_steps``, ``skipped``)."""
        return self._native.drains()

    # -- the state --------------------------------------------------------------------------

    def _box(
        self,
        fqn: str,
        v: torch.Tensor,
        writers: Optional[Dict[str, int]] = None,
        coords: "Optional[Dict[Tuple[str, int], int]]" = None,
    ):
        """(local tensor, global shape, offsets, writer rank or None) of this rank's part;
        ``writers``: the writer of each plain tensor (``_balanced_writers``); ``coords``: the
        writer's coordinate along each ``Replicate()`` dimension of a DTensor
        (``_replicate_coords``)."""
        if DTensor is not None and isinstance(v, DTensor):
            mesh, placements = v.device_mesh, v.placements
            if any(isinstance(p, Partial) for p in placements):
                raise CkptError(
                    f"tensor {fqn!r} is a Partial DTensor: reduce it (redistribute) before saving"
                )
            local = v.to_local()
            shape = list(v.shape)
            _, offsets = compute_local_shape_and_global_offset(v.shape, mesh, placements)
            coord = mesh.get_coordinate()
            writer = None
            if coord is not None:
                want = list(coord)
                for d, p in enumerate(placements):
                    if isinstance(p, Replicate):
                        want[d] = (coords or {}).get((fqn, d), 0)
                if want != list(coord):
                    writer = int(mesh.mesh[tuple(want)].item())
            return local, shape, [int(o) for o in offsets], writer
        shape = list(v.shape)
        writer = (writers or {}).get(fqn, 0) if self.world > 1 else 0
        return v, shape, [0] * len(shape), (None if writer == self.rank else writer)

    def _trainable(self, fqn: str, v: torch.Tensor, local: torch.Tensor) -> bool:
        """Whether training should change ``v``: it requires grad, it is one of the tensors
        named trainable, or it is an optimizer's per-parameter state (a floating tensor under
        a ``state`` component: an optimizer keeps state only for the parameters it updates)."""
        if not local.is_floating_point():
            return False
        if v.requires_grad or local.data_ptr() in self._trainable_ptrs:
            return True
        return "state" in fqn.split(".")[:-1] and local.dim() > 0

    def _prepare(self, state_dict: dict, keep: list):
        """The entries and pickled values of ``state_dict`` (called by the native manager
        only when a checkpoint is due). ``keep`` holds copies of non-contiguous tensors."""
        flat, _ = _flat(state_dict)
        entries, values = [], {}
        plain = [
            (fqn, v.numel() * v.element_size())
            for fqn, v in flat.items()
            if isinstance(v, torch.Tensor) and not (DTensor is not None and isinstance(v, DTensor))
        ]
        writers = _balanced_writers(plain, self.world) if self.world > 1 else {}
        coords = _replicate_coords(flat)
        for fqn, v in flat.items():
            if not isinstance(v, torch.Tensor):
                values[fqn] = v
                continue
            local, shape, offsets, writer = self._box(fqn, v, writers, coords)
            t = local.detach()
            if t.device.type != "cpu":
                raise CkptError(
                    f"tensor {fqn!r} is on {t.device}: ckpt.CheckpointManager saves CPU tensors; "
                    "move the state to host memory, or save through ckpt.dcp.StorageWriter"
                )
            trainable = self._trainable(fqn, v, t)
            if not t.is_contiguous():
                t = t.contiguous()
                keep.append(t)
            entries.append(
                (
                    fqn,
                    _ckpt_dtype(t, fqn),
                    shape,
                    offsets,
                    list(t.shape),
                    _bytes_view(t),
                    writer,
                    trainable,
                )
            )
        pickled = pickle.dumps(values, protocol=4) if self.rank == 0 else b""
        return entries, pickled
