"""Memory and traffic measured, not computed: bytes of the live tensors a rank holds, and the
bytes it sends per step.

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


class CountingAllReduce:
    """A DDP comm hook (torch's contract, for microddp's DDP and torch's) that averages a
    bucket with all_reduce and counts what a ring sends for it: a reduce-scatter and an
    all-gather, `N - 1` chunks of `ceil(n / N)` elements each. `last_step` holds the count
    since the previous `end_step()`."""

    def __init__(self) -> None:
        self.total = 0
        self.last_step = 0
        self._at_step = 0

    def __call__(self, _state, bucket):
        import torch.distributed as dist

        flat = bucket.buffer()
        n = dist.get_world_size()
        self.total += 2 * (n - 1) * (-(-flat.numel() // n)) * flat.element_size()
        flat.div_(n)
        return dist.all_reduce(flat, async_op=True).get_future().then(lambda f: f.value()[0])

    def end_step(self) -> None:
        """Close the step's window: what went out since the previous step ended."""
        self.last_step, self._at_step = self.total - self._at_step, self.total
