"""Memory measured, not computed: bytes of the live tensors a rank holds, for every strategy
(dp, the pipelines, ZeRO; what the training job's `memory` record reports).

Tensors are counted by storage, once each: a parameter that is a view of a flat buffer counts
the buffer, and a buffer emptied between uses (ZeRO-3) counts zero. So the numbers are what
this rank's allocator really holds for parameters, gradients and optimizer state. A DTensor
(FSDP2's parameters, gradients and state) counts its local shard: what this rank holds.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def _storage_bytes(tensors: Iterable[torch.Tensor | None], seen: set) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):  # a DTensor: this rank's part of it
            t = t.to_local()
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes(), t.device)
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def measure(params: Iterable[torch.Tensor] | nn.Module,
            optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """{"params", "grads", "optimizer_state"}: bytes of the live storages behind `params`
    (a module's parameters, or any tensors), their `.grad`s, and every tensor in the
    optimizer's state."""
    params = list(params.parameters() if isinstance(params, nn.Module) else params)
    seen: set = set()
    out = {"params": _storage_bytes((p.detach() for p in params), seen),
           "grads": _storage_bytes((p.grad for p in params), seen)}
    state = []
    if optimizer is not None:
        for per_param in optimizer.state.values():
            state += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
    out["optimizer_state"] = _storage_bytes(state, seen)
    return out
