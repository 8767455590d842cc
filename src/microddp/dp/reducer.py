"""The Reducer: overlapped, bucketed gradient averaging, matching PyTorch's reducer step by step.

During backward, a post-accumulate-grad hook per parameter reports its finished gradient to
its bucket, which holds it in a view, divided by the world size (big gradients are copied in at
once, small ones together when the bucket is complete). When a bucket's last gradient lands,
its all-reduce starts at once, asynchronously, while autograd computes earlier layers. Buckets
start strictly in index order, so every rank issues the same collectives in the same order.
One callback at the end of backward waits for them all and hands the averages to `.grad`.

Unlike PyTorch, the averages of large gradients are not copied out of the bucket: each `.grad`
becomes a view of the reduced buffer (see `_lend`), which saves one pass over every gradient
per step (13 ms of a 190 ms step for FullMLP(1024) here). Before the next backward writes into that buffer, `claim`
makes sure nobody else can see it; if somebody still can, the bucket takes fresh memory.

As in PyTorch: the first iteration uses one bucket (parameter order need not be execution
order), then buckets are rebuilt in the order gradients actually arrived on rank 0, with a
small first bucket (1 MiB) so communication starts early.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import trace
from ..errors import MicroDDPError
from .buckets import FIRST_BUCKET_BYTES, NO_LIMIT, Bucket, bucket_view, plan_buckets, view_layout
from .comm_hooks import CommHook, GradBucket, Summing
from .sync import distributed, global_rank
from .unused import accumulators, find_unused

# Gradients of at least this many elements are copied into their bucket the moment they are
# ready; smaller ones wait and go together, where one call costs less than one call each.
COPY_AT_ONCE = 1 << 16
# A bucket is lent to .grad (not copied back) when its gradients average at least this many
# elements. Lending costs Python work per parameter (about 13 us here, a view and its
# bookkeeping), copying costs bytes (about 5 GB/s): even near 16K elements; lending only
# from twice that. Measured per step: FullMLP(128), 8K elements a gradient on average, 0.45 ms
# lent vs 0.33 ms copied; FullMLP(512), 128K, 0.46 ms lent vs 3.9 ms copied.
LEND_AT_LEAST = 1 << 15


class Reducer:
    """Averages the gradients of `params` over the ranks of `group` during backward."""

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str], group=None,
                 bucket_cap_bytes: int = 25 * 1024 * 1024, first_bucket_bytes: int = FIRST_BUCKET_BYTES,
                 find_unused_parameters: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False) -> None:
        self.params, self.names, self.group = list(params), list(names), group
        self.world_size = dist.get_world_size(group) if distributed(group) else 1
        self.div_factor = self.world_size
        self.caps = [first_bucket_bytes, bucket_cap_bytes]
        self.find_unused, self.as_view, self.static_graph = (
            find_unused_parameters, gradient_as_bucket_view, static_graph)
        self.comm_hook: CommHook | None = None
        self.comm_state = None
        # Rebuilding follows the real arrival order, which is only known when every
        # parameter reports in: not under find_unused_parameters (as in PyTorch).
        self.will_rebuild = static_graph or not find_unused_parameters
        self.arrival: list[int] = []
        self.rebuild_due = False
        self.static_unused: list[int] | None = None
        if static_graph or not find_unused_parameters:
            limits = [NO_LIMIT]
        else:
            limits = self.caps if first_bucket_bytes < bucket_cap_bytes else [bucket_cap_bytes]
        self.set_buckets(plan_buckets(self.params, limits)[::-1])
        self.grad_accs = accumulators(self.params) if (find_unused_parameters or static_graph) else []
        self.numel = [p.numel() for p in self.params]
        self.used = bytearray(len(self.params))  # a list, not a tensor: set once per gradient
        self.handles = [p.register_post_accumulate_grad_hook(lambda _p, i=i: self._on_grad(i))
                        for i, p in enumerate(self.params)]
        self.expect = False
        self._reset_iteration([])

    # -- buckets --------------------------------------------------------------------------
    def set_buckets(self, plan: list[list[int]]) -> None:
        """(Re)allocate flat buffers for `plan` (lists of parameter indices, in launch order)."""
        self.buckets = [Bucket([self.params[i] for i in idx], k, idx) for k, idx in enumerate(plan)]
        # The views each bucket handed to .grad, weakly (None: not lent), and how many references its
        # buffer has while only the reducer holds it (the flat tensor and its own views).
        self.lent: list[list | None] = [None] * len(self.buckets)
        self.alone = [_refs(b.flat) if _CAN_LEND else 0 for b in self.buckets]
        self.lendable = [_CAN_LEND and not self.as_view
                         and b.flat.numel() >= LEND_AT_LEAST * len(b.params) for b in self.buckets]
        self.claimed = bytearray(len(self.buckets))
        # Buckets whose views are all row-major, back to back: `_copy_whole` can fill them.
        self.row_major = [all(v.is_contiguous() for v in b.views) for b in self.buckets]
        # Where each gradient sits in its bucket, worked out once: _lend makes views every step.
        self.layouts = [[view_layout(p, o) for p, o in zip(b.params, b.offsets, strict=True)]
                        for b in self.buckets]
        self.where = {}
        for b in self.buckets:
            for pos, i in enumerate(b.indices):
                self.where[i] = (b, pos)
                p = self.params[i]
                if self.as_view and p.grad is not None:  # keep accumulated grads, now in place
                    b.views[pos].copy_(p.grad)
                    p.grad = b.views[pos]

    def rebuild_buckets(self) -> bool:
        """Re-plan buckets in rank 0's gradient arrival order (once, before a forward)."""
        if not self.rebuild_due:
            return False
        order = torch.tensor(self.arrival, dtype=torch.int64, device=self.params[0].device)
        if distributed(self.group):
            dist.broadcast(order, global_rank(self.group, 0), self.group)
        self.set_buckets(plan_buckets(self.params, self.caps, order=order.tolist()))
        self.rebuild_due, self.will_rebuild, self.arrival = False, False, []
        return True

    # -- one iteration ----------------------------------------------------------------------
    def _reset_iteration(self, unused: list[int]) -> None:
        n = len(self.params)
        self.marked, self.copied, self.zeroed = [False] * n, bytearray(n), set()
        self.next_bucket = 0
        for b in self.buckets:
            b.pending = len(b.params)
        self.futures: list = [None] * len(self.buckets)
        self.launched_at = [0.0] * len(self.buckets)
        self.started = False
        self.unused = unused
        self.used_future = None
        self.recording = self.will_rebuild and not self.rebuild_due
        self.claimed = bytearray(len(self.buckets))
        self.retired = []  # gradients replaced by lent views, freed now (see _lend)

    def prepare_for_backward(self, outputs: Sequence[torch.Tensor]) -> None:
        """Called after a forward whose backward must average gradients."""
        unused: list[int] = []
        if self.find_unused and not self.static_graph:
            unused = find_unused(outputs, self.grad_accs)
        elif self.static_graph:
            if self.static_unused is None:  # the graph is the same every time: look once
                self.static_unused = find_unused(outputs, self.grad_accs)
            unused = self.static_unused
        self.expect = True
        self._reset_iteration(unused)

    def skip_backward(self) -> None:
        """The next backward (no_sync, or no grad) accumulates locally only."""
        self.expect = False

    def _on_grad(self, i: int) -> None:
        """Autograd has finished p.grad for this backward (the hot path: keep it lean)."""
        if self.find_unused and self.params[i].grad is not None:
            self.used[i] = 1  # under no_sync too: a gradient accumulated there is a gradient
        if not self.expect:
            return
        if not self.started:  # first gradient of this backward
            self.started = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            for j in self.unused:  # they will never report: count them in now
                self._mark_ready(j)
        if self.marked[i]:
            raise MicroDDPError(
                f"parameter '{self.names[i]}' received its gradient twice in one backward pass "
                "(reentrant backward or checkpointing?); DistributedDataParallel averages each "
                "gradient once per backward: call backward once per forward")
        if self.recording:
            self.arrival.append(i)
        self._mark_ready(i)

    def _mark_ready(self, i: int, zero: bool = False) -> None:
        self.marked[i] = True
        bucket, pos = self.where[i]
        if not self.claimed[bucket.index]:
            self.claim(bucket)
        if zero:
            self.zeroed.add(i)
        elif self.numel[i] >= COPY_AT_ONCE:  # big: copy now; small ones go together later
            grad = self.params[i].grad
            if grad is not None and not self.as_view and self.comm_hook is None:
                torch.mul(grad, 1.0 / self.div_factor, out=bucket.views[pos])  # the usual case
            else:
                self._copy_in(bucket, [pos])
            self.copied[i] = 1
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready()

    def _copy_in(self, bucket: Bucket, positions: Sequence[int]) -> None:
        """Gradients -> bucket views, divided by the world size (unless a comm hook divides).

        Copy-then-multiply rounds exactly like PyTorch's multiply-while-copying; batching the
        small tensors into two foreach calls saves a dispatch per tensor.
        """
        hooked, div = self.comm_hook is not None, self.div_factor
        if not self.claimed[bucket.index]:
            self.claim(bucket)
        if len(positions) == len(bucket.views) and self._copy_whole(bucket):
            return
        dst, src, owners, alias = [], [], [], []
        for pos in positions:
            i, view = bucket.indices[pos], bucket.views[pos]
            grad = self.params[i].grad
            if grad is None or i in self.zeroed:
                view.zero_()
            elif self.as_view and _same_memory(grad, view):
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

    def _copy_whole(self, bucket: Bucket) -> bool:
        """The whole bucket at once, in the usual case (no comm hook, grads not bucket views,
        every gradient present): one concatenation into the flat buffer, then one multiply
        over it. False, having done nothing, if the case is not the usual one.

        Same results as multiplying each gradient into its view (one rounding per element
        either way), at half the cost: FullMLP(128)'s 33 gradients took 211 us as a copy and a
        multiply per view, 126 us this way (foreach calls over views, measured here).
        """
        if self.comm_hook is not None or self.as_view or self.zeroed or not self.row_major[bucket.index]:
            return False
        grads = _present_grads(bucket)
        if grads is None:
            return False
        if self.lent[bucket.index] is not None and any(_same_memory(g, bucket.flat) for g in grads):
            return False  # a lent view kept by zero_grad: torch.cat cannot read what it writes
        # reshape(-1) reads a gradient in row-major order, which is how its view lays it out.
        torch.cat([g.reshape(-1) for g in grads], out=bucket.flat)
        bucket.flat.mul_(1.0 / self.div_factor)
        return True

    def _launch_ready(self) -> None:
        """Start every bucket whose turn has come: buckets go strictly in order on all ranks."""
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
            k = self.next_bucket
            bucket = self.buckets[k]
            self._copy_in(bucket, [pos for pos, i in enumerate(bucket.indices) if not self.copied[i]])
            self.launched_at[k] = time.perf_counter()
            if self.comm_hook is None:
                self.futures[k] = Summing(bucket.flat, self.group)
            else:
                self.futures[k] = self.comm_hook(self.comm_state, GradBucket(bucket, len(self.buckets)))
            if trace.enabled():
                _record_when_done(self.futures[k], k, bucket.nbytes, self.launched_at[k])
            self.next_bucket += 1
        if self.next_bucket == len(self.buckets) and self.find_unused:
            used = torch.tensor(list(self.used), dtype=torch.int32, device=self.params[0].device)
            self.used_future = Summing(used, self.group)

    def _finish(self) -> None:
        """End of backward: wait for every bucket, write averages into .grad, reset."""
        self.expect, self.started = False, False
        missing = [i for i, m in enumerate(self.marked) if not m]
        if missing:
            # Other ranks may have used these parameters and be waiting for our buckets:
            # send zeros for them (their true gradient here) so no rank hangs, then fail.
            for i in missing:
                if self.recording:
                    self.arrival.append(i)
                self._mark_ready(i, zero=True)
            for fut in self.futures:
                fut.wait()
            self._arrival_complete()
            self.used = bytearray(len(self.params))
            names = [self.names[i] for i in missing]
            listed = ", ".join(f"'{n}'" for n in names[:10]) + (" ..." if len(names) > 10 else "")
            raise MicroDDPError(
                f"{len(names)} parameter(s) got no gradient in this backward pass on rank "
                f"{_rank(self.group)}: {listed}. "
                "Pass find_unused_parameters=True to DistributedDataParallel if some parameters "
                "are legitimately unused, or make every forward output contribute to the loss")
        t0 = time.perf_counter()
        used = None
        if self.used_future is not None:
            used = self.used_future.wait().tolist()
            self.used = bytearray(len(self.params))
        for k, bucket in enumerate(self.buckets):
            result = self.futures[k].wait()
            result = result[0] if isinstance(result, list) else result
            self._write_back(bucket, result, used)
        if trace.enabled():
            trace.add_span("wait comm", t0, time.perf_counter(), track="comm_wait")
        self._arrival_complete()

    def _arrival_complete(self) -> None:
        """Every rank reaches this after the same collectives, so all agree on rebuilding."""
        if self.will_rebuild and not self.rebuild_due:
            self.rebuild_due = len(self.arrival) == len(self.params)
            if not self.rebuild_due:
                self.arrival = []

    def _write_back(self, bucket: Bucket, result: torch.Tensor, used: list[int] | None) -> None:
        same = _same_memory(result, bucket.flat)
        if same and used is None and self.lendable[bucket.index]:
            self._lend(bucket)
            return
        grads = _present_grads(bucket) if same and used is None and not self.as_view else None
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
                if p.grad is None or not _same_memory(p.grad, bucket.views[pos]):
                    p.grad = bucket.views[pos]
            elif p.grad is None:
                p.grad = out.clone()
            else:
                dst.append(p.grad)
                src.append(out)
        if dst:
            torch._foreach_copy_(dst, src)  # one call for the whole bucket

    def _lend(self, bucket: Bucket) -> None:
        """Hand the reduced buffer itself to `.grad`, a view per parameter, instead of copying
        the averages out of it as PyTorch does.

        A `.grad` that already is this buffer's view (zero_grad(set_to_none=False) kept it, and
        autograd accumulated into it) stays the same tensor, as it would with PyTorch. The
        gradients replaced here are kept until the next forward starts (`release_retired`),
        about when PyTorch's would be freed (by zero_grad): freeing 64 MB at the end of
        backward made the C allocator hand the memory back to the system and fault it in again,
        page by page, which cost more than the copy saved (16,000 page faults a step for
        FullMLP(1024), measured). Any later, and they would add to the peak of the forward.
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
        """Free the gradients `_lend` replaced: called as the next forward starts."""
        self.retired = []

    def claim(self, bucket: Bucket, exclusive: bool = False) -> None:
        """Before this backward's first write into `bucket`: if anything besides the reducer and
        the parameters' current `.grad` still refers to its lent buffer (a gradient kept from an
        earlier step, say), give the bucket fresh memory, so what the caller holds never changes.
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

    def remove_hooks(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def _rank(group) -> int:
    return dist.get_rank(group) if distributed(group) else 0


# How many tensors share a storage (flat buffer and views alike): how `claim` tells whether
# anyone else still holds a lent buffer. Without it, reduced gradients are copied, as PyTorch does.
_use_count = getattr(torch._C, "_storage_Use_Count", None)
_CAN_LEND = _use_count is not None


def _refs(flat: torch.Tensor) -> int:
    """How many tensors (and storage handles) refer to `flat`'s memory right now."""
    return _use_count(flat.untyped_storage()._cdata)


def _present_grads(bucket: Bucket) -> list[torch.Tensor] | None:
    """The `.grad` of every parameter in `bucket`, or None if any of them has none."""
    grads = [p.grad for p in bucket.params]
    return None if any(g is None for g in grads) else grads


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _record_when_done(fut, k: int, nbytes: int, launched: float) -> None:
    def note(_fut) -> None:
        trace.add_span(f"allreduce bucket {k}", launched, time.perf_counter(), track="comm",
                       bucket=k, bytes=nbytes)

    fut.add_done_callback(note)
