"""Buckets: many gradients packed back to back in one flat buffer, one view per parameter.

One all-reduce of a few megabytes costs far less than dozens of small ones (each message pays a
fixed latency), so gradients travel in buckets. `plan_buckets` decides which parameters share a
bucket exactly as PyTorch's reducer does, so bucket boundaries (and hence results) match it.
"""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Hashable, Sequence

import torch

from ..errors import MicroDDPError

MiB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25  # PyTorch's default bucket size
FIRST_BUCKET_BYTES = 1 * MiB  # PyTorch's small first bucket, so the first all-reduce starts early
NO_LIMIT = sys.maxsize


def check_bucket_cap(bucket_cap_mb) -> None:
    """None (the default) or a finite positive number of MiB; a string or inf would fail deep
    inside the bucket plan (or never end), so refuse it here in one line."""
    if bucket_cap_mb is None:
        return
    if (isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, numbers.Real)
            or not math.isfinite(bucket_cap_mb) or not bucket_cap_mb > 0):
        raise MicroDDPError(f"bucket_cap_mb must be a positive number of MiB, finite and not "
                            f"a string, got {bucket_cap_mb!r}")


def plan_buckets(params: Sequence[torch.Tensor], limits: Sequence[int],
                 order: Sequence[int] | None = None) -> list[list[int]]:
    """Group parameter indices into buckets of at least `limits[k]` bytes for the k-th bucket.

    Walks the parameters in `order` (default: index order), filling one open bucket per
    (dtype, device), and closes it once it holds `limit` bytes or more; the last limit repeats.
    Without `order`, buckets are sorted by their smallest index; with it, kept in walk order.
    """
    return plan_by_size([p.numel() * p.element_size() for p in params],
                        [(p.dtype, p.device) for p in params], limits, order)


def plan_by_size(sizes: Sequence[int], keys: Sequence[Hashable], limits: Sequence[int],
                 order: Sequence[int] | None = None) -> list[list[int]]:
    """`plan_buckets` over plain numbers: items of `sizes` (any unit, `limits` in the same),
    one open bucket per distinct key (parameters that cannot share a buffer, or a ZeRO
    parameter group), each closed once it holds its limit or more. ZeRO plans its buckets
    with this too, so its bucket boundaries are DDP's."""
    if not sizes:
        return []
    walk = list(range(len(sizes))) if order is None else list(order)
    done: list[list[int]] = []
    open_: dict[Hashable, tuple[list[int], int]] = {}  # key -> (indices, size)
    limit_pos: dict[Hashable, int] = {}
    for i in walk:
        key = keys[i]
        indices, size = open_.get(key, ([], 0))
        indices.append(i)
        size += sizes[i]
        pos = limit_pos.setdefault(key, 0)
        if size >= limits[pos]:
            done.append(indices)
            open_.pop(key, None)
            limit_pos[key] = min(pos + 1, len(limits) - 1)
        else:
            open_[key] = (indices, size)
    done.extend(indices for indices, _ in open_.values())
    if order is None:
        done.sort(key=min)
    return done


def dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill its storage span exactly once, in some dimension order."""
    expected = 1
    dims = sorted((st, s) for s, st in zip(t.shape, t.stride(), strict=True) if s != 1)
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def view_layout(p: torch.Tensor, offset: int) -> tuple:
    """as_strided arguments for p's gradient at `offset` in a flat buffer: p's own strides when
    p fills its memory densely (as autograd lays out grads), else plain row-major ones."""
    if dense(p):
        return p.size(), p.stride(), offset
    return p.size(), torch.empty(p.size(), device="meta").stride(), offset


def bucket_view(flat: torch.Tensor, p: torch.Tensor, offset: int) -> torch.Tensor:
    """The slice of `flat` that holds p's gradient, laid out like p (as autograd lays out grads)."""
    return flat.as_strided(*view_layout(p, offset))


def present_grads(bucket: Bucket) -> list[torch.Tensor] | None:
    """The `.grad` of every parameter in `bucket`, or None if any of them has none."""
    grads = [p.grad for p in bucket.params]
    return None if any(g is None for g in grads) else grads


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors live in the same storage (a view of a bucket and the bucket, say)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# --8<-- [start:bucket]
class Bucket:
    """A flat gradient buffer for `params`, a view per parameter, a count of what is missing."""

    def __init__(self, params: Sequence[torch.Tensor], index: int = 0,
                 indices: Sequence[int] | None = None) -> None:
        self.params = list(params)
        self.index = index
        self.indices = list(indices) if indices is not None else list(range(len(self.params)))
        self.offsets, self.lengths, offset = [], [], 0
        for p in self.params:
            self.offsets.append(offset)
            self.lengths.append(p.numel())
            offset += p.numel()
        first = self.params[0]
        self.flat = torch.zeros(offset, dtype=first.dtype, device=first.device)
        self.views = [bucket_view(self.flat, p, o)
                      for p, o in zip(self.params, self.offsets, strict=True)]
        self.pending = len(self.params)
        self._position = {id(p): k for k, p in enumerate(self.params)}

    @property
    def nbytes(self) -> int:
        """Bytes of the bucket's flat gradient buffer."""
        return self.flat.numel() * self.flat.element_size()

    def add(self, p: torch.Tensor) -> bool:
        """Copy p's gradient into its view; True once every gradient of the bucket has arrived."""
        self.views[self._position[id(p)]].copy_(p.grad)
        self.pending -= 1
        if self.pending == 0:
            self.pending = len(self.params)  # ready for the next backward
            return True
        return False

    def copy_out(self) -> None:
        """Write the (reduced) bucket contents back into each parameter's .grad."""
        for p, view in zip(self.params, self.views, strict=True):
            p.grad.copy_(view)
# --8<-- [end:bucket]
