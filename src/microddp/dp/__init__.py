"""Data parallelism from scratch: the ladder of stages and the real DistributedDataParallel.

    model = microddp.dp.wrap(FullMLP(128), engine="overlap")   # or naive, hooks, buckets,
                                                               # microddp, torch
"""

from __future__ import annotations

from .engine_names import ENGINES


def __getattr__(name: str):
    # Loaded on first use: the engines need torch, their names (ENGINES) do not.
    if name == "wrap":
        from .engines import wrap

        return wrap
    if name in ("DistributedDataParallel", "DDP"):
        from .ddp import DistributedDataParallel

        return DistributedDataParallel
    raise AttributeError(f"module 'microddp.dp' has no attribute {name!r}")


__all__ = ["ENGINES", "wrap", "DistributedDataParallel", "DDP"]
