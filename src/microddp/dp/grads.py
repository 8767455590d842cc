"""A parameter's gradient and its bucket's flat buffer: the copies between them, and the
buffer lent to .grad as a view (gradient_as_bucket_view).

The Reducer (reducer.py) decides *when* a bucket is filled, launched and emptied; its
GradCopier moves gradients into a bucket before its all-reduce and the averages back out,
in as few tensor calls as the case allows, with what it is given (parameters, buckets,
Lender, divisor, flags): a composed object, not a mixin that reads the Reducer's attributes.

The Lender hands each parameter a view of the reduced buffer itself instead of copying the
averages into `.grad` as PyTorch's reducer does (unless gradient_as_bucket_view), which saves
one pass over every gradient per step (chapter 5b). What a caller sees stays as with
PyTorch: before the next backward writes into a lent buffer, `claim` makes sure nobody else
can see it (a gradient kept from an earlier step, say); if somebody still can, the bucket
takes fresh memory. What differs: a lent `.grad` is a view of the bucket, as with
gradient_as_bucket_view=True, so `p.grad.detach_()` fails and `torch.save(p.grad)` writes
the whole bucket (save `p.grad.clone()`).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from .buckets import Bucket, bucket_view, present_grads, same_memory, view_layout


class GradCopier:
    """Gradients -> bucket views (divided by the world size) and averages -> `.grad`.

    The Reducer owns one per bucket plan (a rebuild makes a new one) and decides *when*; this
    object does the copies, in as few tensor calls as the case allows. It is given what never
    changes for a plan (the parameters, the buckets, the Lender, gradient_as_bucket_view) and,
    per call, what may change between backwards (the divisor, the gradients zeroed by Join):
    it reads nothing of the Reducer's.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], buckets: Sequence[Bucket],
                 lender: Lender, as_view: bool) -> None:
        self.params, self.lender, self.as_view = params, lender, as_view
        # Buckets whose views are all row-major, back to back: `_copy_whole` can fill them.
        self.row_major = [all(v.is_contiguous() for v in b.views) for b in buckets]

    def copy_in(self, bucket: Bucket, positions: Sequence[int], div: int | None,
                zeroed: set[int]) -> None:
        """Gradients -> bucket views, divided by `div` (None: a comm hook divides, so only
        copy); the parameters in `zeroed` contribute zeros (a joined rank's shadow backward).

        Copy-then-multiply rounds exactly like PyTorch's multiply-while-copying; batching the
        small tensors into two foreach calls saves a dispatch per tensor.
        """
        hooked = div is None
        if not self.lender.claimed[bucket.index]:
            self.lender.claim(bucket)
        if len(positions) == len(bucket.views) and self._copy_whole(bucket, div, zeroed):
            return
        dst, src, owners, alias = [], [], [], []
        for pos in positions:
            i, view = bucket.indices[pos], bucket.views[pos]
            grad = self.params[i].grad
            if grad is None or i in zeroed:
                view.zero_()
            elif self.as_view and same_memory(grad, view):
                alias.append(view)  # accumulated in place: no copy needed
            else:
                dst.append(view)
                src.append(grad)
                owners.append(i)
        if len(dst) == 1 and not hooked:
            torch.mul(src[0], 1.0 / div, out=dst[0])  # PyTorch's own arithmetic
        elif dst:
            torch._foreach_copy_(dst, src)
            if not hooked:
                torch._foreach_mul_(dst, 1.0 / div)
        if alias and not hooked:
            torch._foreach_div_(alias, div)  # PyTorch divides aliased views in place
        if self.as_view:  # from now on, autograd accumulates straight into the bucket
            for i, view in zip(owners, dst, strict=True):
                self.params[i].grad = view

    def _copy_whole(self, bucket: Bucket, div: int | None, zeroed: set[int]) -> bool:
        """The whole bucket at once, in the usual case (no comm hook, grads not bucket views,
        every gradient present): one concatenation into the flat buffer, then one multiply
        over it. False, having done nothing, if the case is not the usual one.

        Same results as multiplying each gradient into its view (one rounding per element
        either way), at half the cost: FullMLP(128)'s 33 gradients took 211 us as a copy and a
        multiply per view, 126 us this way (foreach calls over views, measured here).
        """
        if div is None or self.as_view or zeroed or not self.row_major[bucket.index]:
            return False
        grads = present_grads(bucket)
        if grads is None:
            return False
        if (self.lender.lent[bucket.index] is not None
                and any(same_memory(g, bucket.flat) for g in grads)):
            return False  # a lent view kept by zero_grad: torch.cat cannot read what it writes
        # reshape(-1) reads a gradient in row-major order, which is how its view lays it out.
        torch.cat([g.reshape(-1) for g in grads], out=bucket.flat)
        bucket.flat.mul_(1.0 / div)
        return True

    def write_back(self, bucket: Bucket, result: torch.Tensor, used: list[int] | None) -> None:
        """The reduced `result` (the bucket's own buffer, or what a comm hook returned) ->
        `.grad`: lent when the bucket is lendable, else copied; `used` (find_unused_parameters)
        marks the parameters no rank used, whose `.grad` stays as it was."""
        same = same_memory(result, bucket.flat)
        if same and used is None and self.lender.lendable[bucket.index]:
            self.lender.lend(bucket)
            return
        grads = present_grads(bucket) if same and used is None and not self.as_view else None
        if grads is not None:  # the usual case: one call, no loop
            torch._foreach_copy_(grads, bucket.views)
            return
        dst, src = [], []
        for pos, (i, p) in enumerate(zip(bucket.indices, bucket.params, strict=True)):
            if used is not None and used[i] == 0:
                continue  # unused on every rank: leave .grad as it was (None stays None)
            out = bucket.views[pos] if same else bucket_view(result, p, bucket.offsets[pos])
            if self.as_view:
                if not same:
                    bucket.views[pos].copy_(out)
                if p.grad is None or not same_memory(p.grad, bucket.views[pos]):
                    p.grad = bucket.views[pos]
            elif p.grad is None:  # a hook may return another dtype (fp16_compress_wrapper)
                p.grad = out.to(p.dtype, copy=True)
            else:
                dst.append(p.grad)
                src.append(out)
        if dst:
            torch._foreach_copy_(dst, src)  # one call for the whole bucket


# A bucket is lent to .grad (not copied back) when its gradients average at least this many
# elements. Lending costs Python work per parameter (about 13 us here, a view and its
# bookkeeping), copying costs bytes (about 5 GB/s): even near 16K elements; lending only
# from twice that. Measured per step: FullMLP(128), 8K elements a gradient on average, 0.45 ms
# lent vs 0.33 ms copied; FullMLP(512), 128K, 0.46 ms lent vs 3.9 ms copied.
LEND_AT_LEAST = 1 << 15

# How many tensors share a storage (flat buffer and views alike): how `claim` tells whether
# anyone else still holds a lent buffer. Without it, reduced gradients are copied, as PyTorch
# does.
_use_count = getattr(torch._C, "_storage_Use_Count", None)
CAN_LEND = _use_count is not None


class Lender:
    """Which of a reducer's buckets are lent to `.grad`, and whether each is still its own."""

    def __init__(self, buckets: list[Bucket], as_view: bool) -> None:
        # The views each bucket handed to .grad, weakly (None: not lent), and how many
        # references its buffer has while only the reducer holds it (flat tensor and views).
        self.lent: list[list | None] = [None] * len(buckets)
        self.alone = [_refs(b.flat) if CAN_LEND else 0 for b in buckets]
        self.lendable = [CAN_LEND and not as_view
                         and b.flat.numel() >= LEND_AT_LEAST * len(b.params) for b in buckets]
        # Where each gradient sits in its bucket, worked out once: `lend` makes views every step.
        self.layouts = [[view_layout(p, o) for p, o in zip(b.params, b.offsets, strict=True)]
                        for b in buckets]
        self.new_backward()

    def new_backward(self) -> None:
        """Start a backward: no bucket claimed yet, no replaced gradient kept."""
        self.claimed = bytearray(len(self.lent))
        self.retired: list = []  # gradients replaced by lent views, freed at the next forward

    def claim(self, bucket: Bucket, exclusive: bool = False) -> None:
        """Before this backward's first write into `bucket`: if anything besides the reducer
        and the parameters' current `.grad` still refers to its lent buffer, give the bucket
        fresh memory, so what the caller holds never changes.
        `exclusive`: the current `.grad`s must not see the writes either (Join's zeros).
        """
        k, lent = bucket.index, self.lent[bucket.index]
        self.claimed[k] = 1
        if lent is None:
            return
        attached = 0 if exclusive else sum(1 for p, v in zip(bucket.params, lent, strict=True)
                                           if p.grad is not None and p.grad is v())
        if _refs(bucket.flat) == self.alone[k] + attached:
            return
        bucket.flat = torch.zeros_like(bucket.flat)
        bucket.views = [bucket_view(bucket.flat, p, o)
                        for p, o in zip(bucket.params, bucket.offsets, strict=True)]
        self.alone[k], self.lent[k] = _refs(bucket.flat), None

    def lend(self, bucket: Bucket) -> None:
        """Hand the reduced buffer to `.grad`, a view per parameter.

        A `.grad` that already is this buffer's view (zero_grad(set_to_none=False) kept it, and
        autograd accumulated into it) stays the same tensor, as it would with PyTorch. The
        gradients replaced here are kept until the next forward starts (`release_retired`),
        about when PyTorch's would be freed (by zero_grad): freeing 64 MB at the end of
        backward made the C allocator hand the memory back to the system and fault it in
        again, page by page, which cost more than the copy saved (16,000 page faults a step
        for FullMLP(1024), measured). Any later, and they would add to the forward's peak.
        """
        before, lent, flat = self.lent[bucket.index], [], bucket.flat
        for pos, (p, layout) in enumerate(zip(bucket.params, self.layouts[bucket.index],
                                              strict=True)):
            if before is None or p.grad is None or p.grad is not before[pos]():
                self.retired.append(p.grad)
                p.grad = flat.as_strided(*layout)  # its own view: the caller may keep it
            lent.append(weakref.ref(p.grad))  # weak: holding it would hide whether others do
        self.lent[bucket.index] = lent

    def release_retired(self) -> None:
        """Free the gradients `lend` replaced: called as the next forward starts."""
        self.retired = []


def _refs(flat: torch.Tensor) -> int:
    """How many tensors (and storage handles) refer to `flat`'s memory right now."""
    return _use_count(flat.untyped_storage()._cdata)
