"""ckpt for PyTorch: ckpt's content-addressed checkpoint store from Python.

``ckpt.CheckpointManager`` is ckpt's own asynchronous checkpointing for a training loop (the
Rust manager: staging pool, background persist, retention, a final checkpoint on SIGTERM;
``ckpt.manager``). ``ckpt.dcp`` holds the storage backend of ``torch.distributed.checkpoint``
(``StorageWriter``/``StorageReader``); ``ckpt.Store`` is the store itself (open by path or URL
as the ``ckpt`` CLI takes it). Every error of ckpt is a ``ckpt.CkptError``.

A script launched by ``ckpt resume`` (which sets torchrun's variables, so
``torch.distributed.init_process_group()`` just works) reads what the supervisor chose with
``ckpt.resume_env()`` (store, run, rank, world, generation, ``resume_step``; None when no
driver launched it) and reports its steps with ``ckpt.Heartbeat`` or ``ckpt.beat(step)``
(no-ops without a driver); ``python/examples/tiny_gpt.py`` is a complete job.
"""

from ckpt._native import (
    DATA_FAILURE_EXIT,
    CkptError,
    Heartbeat,
    RankEnv,
    RankWriter,
    StepReader,
    Store,
    beat,
    resume_env,
)

__all__ = [
    "DATA_FAILURE_EXIT",
    "CkptError",
    "Heartbeat",
    "RankEnv",
    "RankWriter",
    "CheckpointManager",
    "StepReader",
    "Store",
    "beat",
    "resume_env",
]


def __getattr__(name):
    # ``ckpt.CheckpointManager`` imports torch: only when asked for.
    if name == "CheckpointManager":
        from ckpt.manager import CheckpointManager

        return CheckpointManager
    raise AttributeError(f"module 'ckpt' has no attribute {name!r}")
