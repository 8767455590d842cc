"""Copies between parameters (or their gradients) and a bucket's flat buffer.

On the wire a bucket is its parameters end to end, rank r's elements from `bucket.start(r)`:
each rank's part is reduced to it and broadcast from it, so parts need not be equal and the
bucket needs no padding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .plan import Bucket


def pack(bucket: Bucket, tensors: Sequence[torch.Tensor | None], out: torch.Tensor,
         scale: float = 1.0) -> None:
    """Copy `tensors` (one per bucket parameter, indexed like the plan's parameters) end to
    end into `out`, times `scale` in the same pass; a missing tensor (a gradient backward
    never made) counts as zeros."""
    at = 0
    for i, n in zip(bucket.params, bucket.numels, strict=True):
        dst, src = out.narrow(0, at, n), tensors[i]
        if src is None:
            dst.zero_()
        else:
            torch.mul(src.detach().reshape(-1), scale, out=dst)
        at += n


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


def take_own(bucket: Bucket, rank: int, tensors: Sequence[torch.Tensor],
             out: torch.Tensor) -> None:
    """Copy rank `rank`'s elements of `tensors` into `out` (its `sizes[rank]` elements)."""
    for piece in bucket.pieces:
        if piece.rank == rank:
            src = tensors[piece.param].detach().reshape(-1).narrow(0, piece.start, piece.length)
            out.narrow(0, piece.offset, piece.length).copy_(src)
