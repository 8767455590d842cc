"""Copies between parameters (or their gradients) and a bucket's padded slots.

Each copy follows the plan's pieces, so a parameter that straddles two ranks is split without
first building one flat copy of the whole bucket.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .plan import Bucket


def padded(bucket: Bucket, like: torch.Tensor) -> torch.Tensor:
    """The bucket on the wire: `world_size` slots of `cap` elements, padding zeroed."""
    return torch.zeros(bucket.world_size * bucket.cap, dtype=like.dtype, device=like.device)


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


def from_slots(bucket: Bucket, slots: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy every slot's real elements back into `tensors` (written through `.data`)."""
    for piece in bucket.pieces:
        src = slots.narrow(0, piece.rank * bucket.cap + piece.offset, piece.length)
        tensors[piece.param].data.view(-1).narrow(0, piece.start, piece.length).copy_(src)


def take_own(bucket: Bucket, rank: int, tensors: Sequence[torch.Tensor],
             out: torch.Tensor) -> None:
    """Copy rank `rank`'s elements of `tensors` into `out` (its `sizes[rank]` elements)."""
    for piece in bucket.pieces:
        if piece.rank == rank:
            src = tensors[piece.param].detach().reshape(-1).narrow(0, piece.start, piece.length)
            out.narrow(0, piece.offset, piece.length).copy_(src)
