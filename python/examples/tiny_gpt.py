#!/usr/bin/env python3
"""A tiny character-level GPT trained with DDP on CPU ranks (gloo), checkpointed through ckpt.

Under ``ckpt resume`` (which sets torchrun's variables and tells each rank the step to
restore; a spare node keeps the world at 2 ranks after a failure)::

    ckpt resume --store /tmp/ckpts --run tiny-gpt --nodes 2 --spares 1 --logs /tmp/logs -- \\
        python python/examples/tiny_gpt.py --steps 200 --ckpt-every 20 --digest-out /tmp/d.json

or standalone, under torchrun or as one process (it restores the run's newest committed
step, if any)::

    torchrun --nproc-per-node 2 python/examples/tiny_gpt.py --store /tmp/ckpts --run tiny-gpt

Training is deterministic: the weights are seeded, the batch of step ``s`` is drawn from a
generator seeded by ``(seed, s)`` and split over the ranks, and each rank's dropout RNG is part
of the checkpoint. So a run that is killed and resumed ends with the same weights, bit for
bit, as one that never stopped (at the same world size). Every ``--ckpt-every`` steps and at
the last, the model, the AdamW state, the progress and every rank's RNG state go through
``torch.distributed.checkpoint`` into the ckpt store (``ckpt.dcp.StorageWriter``); at the end
rank 0 prints a SHA-256 of the weights and optimizer state and writes it to ``--digest-out``.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import socket
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

import ckpt
from ckpt.dcp import StorageReader, StorageWriter

CORPUS = Path(__file__).resolve().parent / "data" / "sonnets.txt"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--store", default=os.environ.get("CKPT_STORE"),
                   help="the ckpt store, a directory or URL (default: $CKPT_STORE)")
    p.add_argument("--run", default=None,
                   help="the run (default: the one ckpt resume names, else tiny-gpt)")
    p.add_argument("--steps", type=int, default=200, help="train up to this step")
    p.add_argument("--ckpt-every", type=int, default=20, help="checkpoint every N steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=16,
                   help="sequences per step over all ranks (a multiple of the world size)")
    p.add_argument("--context", type=int, default=32, help="characters per sequence")
    p.add_argument("--d-model", type=int, default=48)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="seconds to pause after each step (demos and tests kill a rank midway)")
    p.add_argument("--corpus", type=Path, default=CORPUS, help="the training text")
    p.add_argument("--digest-out", type=Path, default=None,
                   help="rank 0 writes the final digest here as JSON")
    return p.parse_args(argv)


# -- the model ------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        y = (self.drop(att) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, context: int, d: int, layers: int, heads: int,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1])))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


# -- data: the batch of a step is a function of the step -------------------------------------


def batch_of(data: torch.Tensor, step: int, args, rank: int, world: int):
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - args.context - 1, (args.batch,), generator=g)
    per = args.batch // world
    mine = starts[rank * per:(rank + 1) * per]
    x = torch.stack([data[s:s + args.context] for s in mine])
    y = torch.stack([data[s + 1:s + 1 + args.context] for s in mine])
    return x, y


# -- checkpoint state -----------------------------------------------------------------------


def app_state(model, opt, step: int, args, rank: int) -> dict:
    """What a checkpoint holds: the model, AdamW's state (by parameter name, the same for any
    world size), the progress, and this rank's RNG state (dropout), each rank's under its own
    name."""
    msd, osd = get_state_dict(model, opt)
    return {
        "model": msd,
        "optim": osd,
        "progress": {"step": step, "seed": args.seed, "batch": args.batch},
        "rng": {f"rank{rank}": io.BytesIO(torch.get_rng_state().numpy().tobytes())},
    }


def restore(model, opt, store: str, run: str, step: int, args, rank: int) -> None:
    state = app_state(model, opt, 0, args, rank)
    state["progress"] = {"step": 0, "seed": 0, "batch": 0}
    dcp.load(state, storage_reader=StorageReader(store, run=run, step=step))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got = state["progress"]
    if got["step"] != step:
        raise ckpt.CkptError(f"step {step} of run {run!r} holds the progress of step {got['step']}")
    if (got["seed"], got["batch"]) != (args.seed, args.batch):
        raise ckpt.CkptError(
            f"run {run!r} was trained with --seed {got['seed']} --batch {got['batch']}; "
            f"resuming it with --seed {args.seed} --batch {args.batch} would change every number"
        )
    rng = state["rng"][f"rank{rank}"]
    rng = rng.getvalue() if isinstance(rng, io.BytesIO) else rng
    torch.set_rng_state(torch.frombuffer(bytearray(rng), dtype=torch.uint8))


def is_data_failure(e: BaseException) -> bool:
    """Whether restoring failed because of the stored data (an object missing or damaged),
    looking through DCP's CheckpointException, which gathers each rank's error."""
    todo, seen = [e], set()
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, tuple):
            todo.extend(y for y in x if isinstance(y, BaseException))
            continue
        if isinstance(x, ckpt.CkptError) and getattr(x, "kind", "") in ("not found", "damaged data"):
            return True
        todo.extend([x.__cause__, x.__context__])
        todo.extend((getattr(x, "failures", None) or {}).values())
    return False


def digest(model, opt) -> str:
    """SHA-256 of the weights and the optimizer state: names, dtypes, shapes and bytes."""
    msd, osd = get_state_dict(model, opt)
    h = hashlib.sha256()

    def walk(prefix: str, v) -> None:
        if isinstance(v, dict):
            for k in sorted(v, key=str):
                walk(f"{prefix}.{k}", v[k])
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(f"{prefix}.{i}", x)
        elif isinstance(v, torch.Tensor):
            t = v.detach().contiguous()
            h.update(f"{prefix}:{t.dtype}:{list(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{prefix}={v!r}".encode())

    walk("model", msd)
    walk("optim", osd)
    return h.hexdigest()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log(rank: int, msg: str) -> None:
    print(f"[rank {rank}] {msg}", flush=True)


# -- the job --------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    # What `ckpt resume` chose for this rank (None when it did not launch the process).
    env = ckpt.resume_env()
    if env is not None:
        if args.run is not None and args.run != env.run:
            sys.exit(f"--run {args.run} differs from the run ckpt resume supervises ({env.run})")
        store, run = env.store, env.run
    else:
        store, run = args.store, args.run or "tiny-gpt"
    if not store:
        sys.exit("no store: pass --store or set CKPT_STORE")

    # torchrun's variables come from `ckpt resume` or torchrun; one process alone needs none.
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        sys.exit(f"--batch {args.batch} is not a multiple of the {world} ranks")

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    text = args.corpus.read_text(encoding="utf-8")
    vocab = sorted(set(text))
    data = torch.tensor([vocab.index(c) for c in text], dtype=torch.long)
    torch.manual_seed(args.seed)
    model = DDP(TinyGPT(len(vocab), args.context, args.d_model, args.layers, args.heads))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    torch.manual_seed(args.seed * 7919 + 1 + rank)  # this rank's dropout

    # The step to restore: exactly what the supervisor chose (None: from scratch), or
    # standalone the run's newest committed step.
    if env is not None:
        resume = env.resume_step
    else:
        found = [ckpt.Store(store).latest_committed(run) if rank == 0 else None]
        dist.broadcast_object_list(found, src=0)
        resume = found[0]
    if resume is not None:
        t0 = time.monotonic()
        try:
            restore(model, opt, store, run, resume, args, rank)
        except Exception as e:
            if env is not None and is_data_failure(e):
                # The supervisor checks that step and picks an older one if it is damaged.
                log(rank, f"cannot restore step {resume} of {run}: {e}")
                return ckpt.DATA_FAILURE_EXIT
            raise
        log(rank, f"restored step {resume} of {run} in {time.monotonic() - t0:.2f} s")

    # Heartbeats to the supervisor (nothing without one): from here on, a thread beats in
    # between steps and each step reports its progress and this rank's loss.
    heartbeat = ckpt.Heartbeat()
    start = (resume or 0) + 1
    heartbeat.step(start - 1)
    model.train()
    loss_value = float("nan")
    for step in range(start, args.steps + 1):
        x, y = batch_of(data, step, args, rank, world)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_value = loss.item()
        heartbeat.step(step, loss=loss_value, samples=y.numel())
        if rank == 0 and (step % 10 == 0 or step == args.steps):
            log(rank, f"step {step} loss {loss_value:.4f}")
        if step % args.ckpt_every == 0 or step == args.steps:
            writer = StorageWriter(store, run=run, step=step)
            dcp.save(app_state(model, opt, step, args, rank), storage_writer=writer)
            if rank == 0:
                log(rank, f"checkpoint {run}@{step} committed ({writer.report})")
        if args.step_sleep > 0:
            time.sleep(args.step_sleep)

    final = digest(model, opt)
    if rank == 0:
        log(rank, f"final digest {final} at step {args.steps}")
        if args.digest_out is not None:
            out = {
                "run": run,
                "step": args.steps,
                "digest": final,
                "loss": loss_value,
                "resumed_from": resume,
                "generation": None if env is None else env.generation,
                "world": world,
            }
            tmp = args.digest_out.with_name(f".{args.digest_out.name}.partial")
            tmp.write_text(json.dumps(out) + "\n")
            os.replace(tmp, args.digest_out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
