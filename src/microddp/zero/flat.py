"""Copies between parameters (or their gradients) and a bucket's flat buffer.

On the wire a bucket is its parameters end to end, rank r's elements from `bucket.start(r)`:
each rank's part is reduced to it and broadcast from it, so parts need not be equal and the
bucket needs no padding. A rank packs its gradients in two (`pack`): its own part
straight into its shard gradient, the others' parts into a buffer that only has to live until
they are sent.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .plan import Bucket


def pack(bucket: Bucket, rank: int, tensors: Sequence[torch.Tensor | None],
         own: torch.Tensor, rest: torch.Tensor, scale: float = 1.0) -> None:
    """Copy `tensors` (one per bucket parameter, indexed like the plan's parameters) times
    `scale`, in the same pass: rank `rank`'s part of the bucket into `own` (its `sizes[rank]`
    elements), the other ranks' parts end to end into `rest` (see `part`). A missing tensor
    (a gradient backward never made) counts as zeros."""
    lo, hi = bucket.start(rank), bucket.start(rank) + bucket.sizes[rank]
    # (first, last, out, to): the bucket's elements [first, last) go to `out` from element `to`
    segments = [(0, lo, rest, 0), (lo, hi, own, 0), (hi, bucket.numel, rest, lo)]
    at = 0
    for i, n in zip(bucket.params, bucket.numels, strict=True):
        src = tensors[i]
        src = None if src is None else src.detach().reshape(-1)
        for first, last, out, to in segments:
            a, b = max(at, first), min(at + n, last)
            if a < b:
                dst = out.narrow(0, to + a - first, b - a)
                if src is None:
                    dst.zero_()
                else:
                    torch.mul(src.narrow(0, a - at, b - a), scale, out=dst)
        at += n


def part(bucket: Bucket, r: int, rank: int, own: torch.Tensor,
         rest: torch.Tensor) -> torch.Tensor:
    """Rank `r`'s part of a bucket that rank `rank` packed into `own` and `rest`."""
    if r == rank:
        return own
    at = bucket.start(r) - (bucket.sizes[rank] if r > rank else 0)
    return rest.narrow(0, at, bucket.sizes[r])


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
