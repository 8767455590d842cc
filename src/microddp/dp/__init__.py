"""Data parallelism from scratch: the ladder of stages and the real DistributedDataParallel.

    model = microddp.dp.wrap(FullMLP(128), engine="overlap")   # or naive, hooks, buckets,
                                                               # microddp, torch
"""

from __future__ import annotations

from .engines import ENGINES, wrap


def __getattr__(name: str):
    if name in ("DistributedDataParallel", "DDP"):
        from .ddp import DistributedDataParallel

        return DistributedDataParallel
    raise AttributeError(f"module 'microddp.dp' has no attribute {name!r}")


__all__ = ["ENGINES", "wrap", "DistributedDataParallel", "DDP"]
