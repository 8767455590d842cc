"""Copies between parameters (or their gradients) and a bucket's padded slots.

Each copy follows the plan's pieces, so a parameter that straddles two ranks is split without
first building one flat copy of the whole bucket.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .plan import Bucket


def padded(bucket: Bucket, like: torch.Tensor) -> torch.Tensor:
    """The bucket on the wire: `world_size` slots of `cap` elements, padding zeroed (only the
    padding: the rest is about to be overwritten, and zeroing it would be one more pass over
    the whole bucket)."""
    out = torch.empty(bucket.world_size * bucket.cap, dtype=like.dtype, device=like.device)
    for r, size in enumerate(bucket.sizes):
        out.narrow(0, r * bucket.cap + size, bucket.cap - size).zero_()
    return out


def flat_views(bucket: Bucket, params: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flat buffer holding the bucket's parameters end to end, their values copied in;
    each parameter becomes a view of it for good, so a collective into the buffer updates
    the parameters themselves, with no copy back."""
    like = params[bucket.params[0]]
    flat = torch.empty(bucket.numel, dtype=like.dtype, device=like.device)
    at = 0
    for i, n in zip(bucket.params, bucket.numels, strict=True):
        view = flat.narrow(0, at, n).view_as(params[i])
        view.copy_(params[i].detach())
        params[i].data = view
        at += n
    return flat


def to_slots(bucket: Bucket, tensors: Sequence[torch.Tensor | None], out: torch.Tensor) -> None:
    """Copy `tensors` (one per bucket parameter, indexed like the plan's parameters) into
    `out`'s slots; a missing tensor (a gradient backward never made) counts as zeros."""
    for piece in bucket.pieces:
        src = tensors[piece.param]
        dst = out.narrow(0, piece.rank * bucket.cap + piece.offset, piece.length)
        if src is None:
            dst.zero_()
        else:
            dst.copy_(src.detach().reshape(-1).narrow(0, piece.start, piece.length))


def take_own(bucket: Bucket, rank: int, tensors: Sequence[torch.Tensor],
             out: torch.Tensor) -> None:
    """Copy rank `rank`'s elements of `tensors` into `out` (its `sizes[rank]` elements)."""
    for piece in bucket.pieces:
        if piece.rank == rank:
            src = tensors[piece.param].detach().reshape(-1).narrow(0, piece.start, piece.length)
            out.narrow(0, piece.offset, piece.length).copy_(src)
