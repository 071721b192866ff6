"""ckpt for PyTorch: ckpt's content-addressed checkpoint store from Python.

``ckpt.dcp`` holds the storage backend of ``torch.distributed.checkpoint``
(``StorageWriter``/``StorageReader``); ``ckpt.Store`` is the store itself (open by path or URL
as the ``ckpt`` CLI takes it). Every error of ckpt is a ``ckpt.CkptError``.
"""

from ckpt._native import CkptError, RankWriter, StepReader, Store

__all__ = ["CkptError", "RankWriter", "StepReader", "Store"]
