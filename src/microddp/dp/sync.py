"""Making replicas identical: check that every rank built the same model, then copy rank 0's
parameters and buffers to everyone (a replica that starts different stays different)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..comms import get_world
from ..errors import MicroDDPError
from .buckets import MiB, plan_buckets

BROADCAST_BUCKET_BYTES = 250 * MiB  # PyTorch's broadcast_bucket_size


def distributed(group=None) -> bool:
    return get_world().distributed and dist.is_initialized()


def global_rank(group, group_rank: int) -> int:
    """The global rank of `group_rank` in `group` (collectives take global ranks)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


@torch.no_grad()
def broadcast_coalesced(tensors: Sequence[torch.Tensor], src: int = 0, group=None,
                        bucket_bytes: int = BROADCAST_BUCKET_BYTES) -> None:
    """Overwrite `tensors` with rank `src`'s copies, a few large messages instead of many small."""
    tensors = [t for t in tensors if t.numel() > 0]
    if not tensors or not distributed(group):
        return
    for indices in plan_buckets(tensors, [bucket_bytes]):
        chunk = [tensors[i] for i in indices]
        flat = _flatten_dense_tensors([t.detach() for t in chunk])
        dist.broadcast(flat, src, group)
        for t, new in zip(chunk, _unflatten_dense_tensors(flat, chunk), strict=True):
            t.copy_(new)


def describe(module: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """Name, shape and dtype of every parameter and buffer: what all replicas must agree on."""
    items = [("parameter", n, t) for n, t in module.named_parameters()]
    items += [("buffer", n, t) for n, t in module.named_buffers()]
    return [(f"{kind} '{n}'", tuple(t.shape), str(t.dtype).replace("torch.", ""))
            for kind, n, t in items]


def verify_same_model(module: nn.Module, group=None) -> None:
    """Raise MicroDDPError on every rank (not a hang on some) if the replicas' layouts differ."""
    if not distributed(group):
        return
    mine = describe(module)
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    problem = first_difference(everyone)
    if problem:
        raise MicroDDPError(
            f"the model differs across ranks: {problem}; build the same model (same code, same "
            "arguments) on every rank before wrapping it in DistributedDataParallel")


def first_difference(everyone: list[list[tuple]]) -> str | None:
    """Describe the first parameter or buffer whose name, shape or dtype is not the same everywhere."""
    tables = [{name: (shape, dtype) for name, shape, dtype in desc} for desc in everyone]
    names = list(dict.fromkeys(name for desc in everyone for name, _, _ in desc))
    for name in names:
        seen: dict[str, list[int]] = {}
        for rank, table in enumerate(tables):
            if name in table:
                shape, dtype = table[name]
                what = f"shape {tuple(shape)} {dtype}"
            else:
                what = "no such entry"
            seen.setdefault(what, []).append(rank)
        if len(seen) > 1:
            parts = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {w}"
                              for w, r in seen.items())
            return f"{name} is not the same everywhere ({parts})"
    orders = {tuple(name for name, _, _ in desc) for desc in everyone}
    if len(orders) > 1:
        return "parameters and buffers are registered in a different order on different ranks"
    return None


def sync_module_states(module: nn.Module, src: int = 0, group=None, buffers: bool = True) -> None:
    """Copy rank `src`'s parameters (and buffers) into every replica."""
    tensors = [p for p in module.parameters()]
    if buffers:
        tensors += [b for b in module.buffers()]
    broadcast_coalesced(list(dict.fromkeys(tensors)), src, group)
