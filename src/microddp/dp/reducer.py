"""The Reducer: overlapped, bucketed gradient averaging, matching PyTorch's reducer step by step.

During backward, a post-accumulate-grad hook per parameter reports its finished gradient to
its bucket, which holds it in a view, divided by the world size (big gradients are copied in at
once, small ones together when the bucket is complete). When a bucket's last gradient lands,
its all-reduce starts at once, asynchronously, while autograd computes earlier layers. Buckets
start strictly in index order, so every rank issues the same collectives in the same order.
One callback at the end of backward waits for them all and hands the averages to `.grad`
(large ones lent, not copied: lending.py).

As in PyTorch: the first iteration uses one bucket (parameter order need not be execution
order), then buckets are rebuilt in the order gradients actually arrived on rank 0, with a
small first bucket (1 MiB) so communication starts early. With static_graph, the first
iteration also learns from the hooks which parameters get no gradient, and how many times
each is reported (activation checkpointing can report one twice), and later ones rely on it.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import spans
from ..comms import distributed, group_rank, group_size
from ..errors import MicroDDPError
from .buckets import FIRST_BUCKET_BYTES, NO_LIMIT, Bucket, plan_buckets
from .comm_hooks import CommHook, Summing, finish, start_reduction
from .double_backward import DoubleBackward
from .grads import GradCopier, Lender
from .logging_data import RuntimeStats
from .refusals import refusal
from .unused import accumulators, find_unused, no_gradient

# Gradients of at least this many elements are copied into their bucket the moment they are
# ready; smaller ones wait and go together, where one call costs less than one call each.
COPY_AT_ONCE = 1 << 16
# A bucket is all-reduced asynchronously, behind the rest of backward, only if the gradients
# still to come after it hold at least this share of its bytes; else it runs at once on the
# hook's thread. With less backward left, nothing hides its all-reduce, and handing it to
# another thread and back (shared memory's lane, gloo's) costs more than the call: for
# FullMLP(128)'s one bucket (1 MiB, rebuilt: its gradients come to just over the 1 MiB first
# bucket), 0.6 ms async + wait against 0.4 ms at once (load 2). Bytes stand in for the
# backward work left: the rebuilt plan follows the order gradients arrive in.
HIDE_SHARE = 1 / 16


def at_once(sizes: Sequence[int]) -> list[bool]:
    """For buckets of `sizes` bytes in launch order: whether each one is reduced at once on
    the hook's thread (True) rather than asynchronously (HIDE_SHARE). The last one always is:
    nothing is left to hide it behind."""
    after, out = 0, []
    for size in reversed(sizes):
        out.append(after < HIDE_SHARE * size)
        after += size
    return out[::-1]


class Reducer(DoubleBackward):
    """Averages the gradients of `params` over the ranks of `group` during backward."""

    def __init__(self, params: Sequence[torch.nn.Parameter], names: Sequence[str], group=None,
                 bucket_cap_bytes: int = 25 * 1024 * 1024,
                 first_bucket_bytes: int = FIRST_BUCKET_BYTES,
                 find_unused_parameters: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False) -> None:
        self.params, self.names, self.group = list(params), list(names), group
        self.world_size = group_size(group)
        self.div_factor = self.world_size
        self.caps = [first_bucket_bytes, bucket_cap_bytes]
        # With static_graph, find_unused_parameters makes no difference (as in torch): the
        # first iteration finds the unused parameters once and for all.
        self.find_unused = find_unused_parameters and not static_graph
        self.as_view, self.static_graph = gradient_as_bucket_view, static_graph
        self.comm_hook: CommHook | None = None
        self.comm_state = None
        # Rebuilding follows the real arrival order, which is only known when every
        # parameter reports in: not under find_unused_parameters (as in PyTorch).
        self.will_rebuild = not self.find_unused
        self.arrival: list[int] = []
        self.rebuild_due = False
        # static_graph, learnt in the first iteration: how many times each parameter's hook
        # fires in one backward (None until then), and which parameters no rank uses.
        self.expected: list[int] | None = None
        self.static_unused: list[int] = []
        self.static_used: list[int] | None = None
        limits = ([NO_LIMIT] if not self.find_unused else
                  self.caps if first_bucket_bytes < bucket_cap_bytes else [bucket_cap_bytes])
        self.set_buckets(plan_buckets(self.params, limits)[::-1])
        self.first_sizes = [b.nbytes for b in self.buckets]  # before any rebuild (logging)
        self.has_rebuilt = False
        self.stats = RuntimeStats()
        self.graphs: dict[int, torch.Tensor] = {}  # backward(create_graph=True) only
        self.grad_accs = accumulators(self.params) if self.find_unused else []
        self.numel = [p.numel() for p in self.params]
        self.used = bytearray(len(self.params))  # a list, not a tensor: set once per gradient
        # The hooks hold the reducer weakly, and go with it: a model wrapped again must not
        # keep its old reducer (and buckets) alive, nor report to it.
        me = weakref.ref(self)
        self.handles = [p.register_post_accumulate_grad_hook(
            lambda _p, i=i: _report(me, i)) for i, p in enumerate(self.params)]
        weakref.finalize(self, _remove_all, self.handles)
        self.expect = False
        self._reset_iteration([])

    # -- buckets --------------------------------------------------------------------------
    def set_buckets(self, plan: list[list[int]]) -> None:
        """(Re)allocate flat buffers for `plan` (lists of parameter indices, in launch order)."""
        self.buckets = [Bucket([self.params[i] for i in idx], k, idx)
                        for k, idx in enumerate(plan)]
        self.now = at_once([b.nbytes for b in self.buckets])
        # Composed, not inherited: each is handed what it needs and reads nothing of ours.
        self.lender = Lender(self.buckets, self.as_view)
        self.copier = GradCopier(self.params, self.buckets, self.lender, self.as_view)
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
            dist.broadcast(order, group=self.group, group_src=0)
        self.set_buckets(plan_buckets(self.params, self.caps, order=order.tolist()))
        self.rebuild_due, self.will_rebuild, self.arrival = False, False, []
        self.has_rebuilt = True
        return True

    def _rebuild_buckets(self) -> bool:
        """torch's name (Lightning calls it before `prepare_for_backward`)."""
        return self.rebuild_buckets()

    def _delay_all_reduce(self) -> None:
        """torch's static_graph first-iteration flush (Lightning calls it after a manual
        backward). Nothing to do here: that backward's end averaged everything already."""

    def claim(self, bucket: Bucket, exclusive: bool = False) -> None:
        """Make `bucket` safe to write before this backward's first write (see Lender.claim)."""
        self.lender.claim(bucket, exclusive)

    def release_retired(self) -> None:
        """Free the gradients that lent views replaced in the last backward."""
        self.lender.release_retired()

    # -- one iteration ----------------------------------------------------------------------
    def _reset_iteration(self, unused: list[int]) -> None:
        n = len(self.params)
        self.marked, self.copied, self.zeroed = [False] * n, bytearray(n), set()
        self.hits = [0] * n  # hooks fired per parameter in this backward (static_graph)
        self.next_bucket = 0
        for b in self.buckets:
            b.pending = len(b.params)
        self.futures: list = [None] * len(self.buckets)
        self.launched_at = [0.0] * len(self.buckets)
        self.started = False
        self.unused = unused
        self.used_future = None
        self.recording = self.will_rebuild and not self.rebuild_due
        self.lender.new_backward()
        self.ready_order: list[int] = []  # hooks in the order they fired, as torch logs them

    def set_divisor(self, n: int) -> None:
        """Divide the summed gradients by `n` (the world size, or under a join the ranks still
        training, if the join says so)."""
        self.div_factor = n

    def _divisor(self) -> int | None:
        """What the copier divides gradients by: None when a comm hook does the dividing."""
        return None if self.comm_hook is not None else self.div_factor

    def skip_iteration(self) -> None:
        """A backward this rank only shadowed with zeros (it joined): learn nothing from it,
        and rebuild buckets when the ranks that ran it do."""
        if self.learning():  # the others learnt their graph in this backward; this rank, which
            self.expected = [0] * len(self.params)  # trains no more, just stops asking
        if self.will_rebuild and not self.rebuild_due:  # the others will rebuild: so must we
            self.arrival, self.rebuild_due = list(range(len(self.params))), True

    def learning(self) -> bool:
        """Whether this is static_graph's first iteration, which learns the graph's shape."""
        return self.static_graph and self.expected is None

    def all_reduces_used(self) -> bool:
        """Whether this backward all-reduces which parameters each rank used (Join copies it)."""
        return self.find_unused or self.learning()

    def prepare_for_backward(self, outputs: Sequence[torch.Tensor]) -> None:
        """Called after a forward whose backward must average gradients."""
        unused: list[int] = []
        if self.find_unused:
            unused = find_unused(outputs, self.grad_accs)
        elif self.static_graph:
            unused = self.static_unused
        self.expect = True
        self._reset_iteration(unused)

    def _on_grad(self, i: int) -> None:
        """Autograd has finished p.grad for this backward (the hot path: keep it lean)."""
        if self.find_unused and self.params[i].grad is not None:
            self.used[i] = 1  # under no_sync too: a gradient accumulated there is a gradient
        if not self.expect:
            return
        if not self.started:  # first gradient of this backward
            self.started = True
            self.stats.mark("backward_compute_time_start")
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            for j in self.unused:  # they will never report: count them in now
                self._mark_ready(j)
        if self.static_graph:
            self.hits[i] += 1
            if self.expected is None:  # first iteration: all-reduce at the end, as torch does
                if self.recording:
                    self.arrival.append(i)
                return
            self.ready_order.append(i)
            if self.hits[i] != self.expected[i]:
                if self.hits[i] < self.expected[i]:
                    return  # more of this gradient is still to come in this backward
                raise MicroDDPError(
                    f"static_graph=True, but parameter '{self.names[i]}' got a gradient "
                    f"{self.hits[i]} times in this backward, against {self.expected[i]} in the "
                    "first one: the graph changed; drop static_graph=True")
        else:
            self.ready_order.append(i)  # torch's prev_iteration_grad_ready_order_indices
            if self.marked[i]:
                raise MicroDDPError(
                    f"parameter '{self.names[i]}' received its gradient twice in one backward pass "
                    "(reentrant backward or checkpointing?); DistributedDataParallel averages each "
                    "gradient once per backward: call backward once per forward, or pass "
                    "static_graph=True if the graph is the same in every iteration")
        if self.recording:
            self.arrival.append(i)
        self._mark_ready(i)

    def _mark_ready(self, i: int, zero: bool = False) -> None:
        self.marked[i] = True
        bucket, pos = self.where[i]
        if not self.lender.claimed[bucket.index]:
            self.claim(bucket)
        if zero:
            self.zeroed.add(i)
        elif self.numel[i] >= COPY_AT_ONCE:  # big: copy now; small ones go together later
            grad = self.params[i].grad
            if grad is not None and not self.as_view and self.comm_hook is None:
                torch.mul(grad, 1.0 / self.div_factor, out=bucket.views[pos])  # the usual case
            else:
                self.copier.copy_in(bucket, [pos], self._divisor(), self.zeroed)
            self.copied[i] = 1
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Start every bucket whose turn has come: buckets go strictly in order on all ranks."""
        while (self.next_bucket < len(self.buckets)
               and self.buckets[self.next_bucket].pending == 0):
            k = self.next_bucket
            bucket = self.buckets[k]
            self.copier.copy_in(bucket, [pos for pos, i in enumerate(bucket.indices)
                                         if not self.copied[i]], self._divisor(), self.zeroed)
            self.launched_at[k] = time.perf_counter()
            if k == 0:
                self.stats.mark("backward_comm_time_start")
            self.futures[k] = start_reduction(bucket, len(self.buckets), self.group,
                                              self.comm_hook, self.comm_state, self.now[k])
            if spans.enabled():
                spans.add_when_done([self.futures[k]], f"allreduce bucket {k}",
                                    self.launched_at[k], bucket=k, bytes=bucket.nbytes)
                if self.now[k] and isinstance(self.futures[k], Summing):  # it ran just now,
                    # inside backward: a wait for communication, not compute (spans.step_stats)
                    spans.add_span(f"wait bucket {k}", self.launched_at[k], time.perf_counter(),
                                   track="comm_wait")
            self.next_bucket += 1
        if self.next_bucket == len(self.buckets) and self.all_reduces_used():
            used = (self.used if self.find_unused else [int(h > 0) for h in self.hits])
            used = torch.tensor(list(used), dtype=torch.int32, device=self.params[0].device)
            self.used_future = Summing(used, self.group, now=True)  # backward is over

    def _finish(self) -> None:
        """End of backward: wait for every bucket, write averages into .grad, reset."""
        self.expect, self.started = False, False
        self.stats.mark("backward_compute_time_end")
        learning = self.learning()
        if learning:  # static_graph's first backward: its gradients go now, all together
            final = list(dict.fromkeys(reversed(self.arrival)))[::-1]  # by each's last report
            self.arrival = []
            for i in final:
                if self.recording:
                    self.arrival.append(i)
                self._mark_ready(i)
        missing = [i for i, m in enumerate(self.marked) if not m]
        # Other ranks may have used these parameters and be waiting for our buckets: send
        # zeros for them (their true gradient here) so no rank hangs. Under
        # find_unused_parameters that is all: a parameter the outputs reach but the loss does
        # not (an unused head) is unused here, and the used map decides (as torch's _DDPSink).
        # So it is in static_graph's first backward, which learns that they are unused.
        for i in missing:
            if self.recording:
                self.arrival.append(i)
            self._mark_ready(i, zero=True)
        if learning:
            self.expected = list(self.hits)
            self.static_unused = missing
        elif missing and not self.find_unused:
            for fut in self.futures:
                finish(fut)
            self._arrival_complete()
            raise MicroDDPError(no_gradient(self.names, self.params, missing, _rank(self.group)))
        t0 = time.perf_counter()
        self._drop_graph_grads()
        used = self.static_used
        if self.used_future is not None:
            used = finish(self.used_future).tolist()
            self.used = bytearray(len(self.params))
            if self.static_graph:  # learnt once: unused on every rank stays unused
                self.static_used = None if all(used) else used
        for k, bucket in enumerate(self.buckets):
            result = finish(self.futures[k])
            result = result[0] if isinstance(result, list) else result
            self.copier.write_back(bucket, result, used)
        if spans.enabled():
            spans.add_span("wait comm", t0, time.perf_counter(), track="comm_wait")
        self.stats.backward_done(self.ready_order)
        self._arrival_complete()

    def __getattr__(self, name: str):
        """A method of torch's C++ reducer that this one lacks: say so, not AttributeError."""
        if name in _TORCH_REDUCER:
            raise refusal(name, "reducer")
        raise AttributeError(f"'Reducer' object has no attribute '{name}'")

    def _arrival_complete(self) -> None:
        """Every rank reaches this after the same collectives, so all agree on rebuilding."""
        if self.will_rebuild and not self.rebuild_due:
            self.rebuild_due = len(self.arrival) == len(self.params)
            if not self.rebuild_due:
                self.arrival = []


def _report(reducer: weakref.ref, i: int) -> None:
    r = reducer()
    if r is not None:
        if torch.is_grad_enabled():  # autograd runs hooks with grad on under create_graph=True
            r._on_graph_grad(i)
        else:
            r._on_grad(i)


# torch 2.13's torch._C._distributed_c10d.Reducer methods, which code reaching into
# `ddp.reducer` may call; the ones this Reducer has are simply found first.
_TORCH_REDUCER = frozenset(
    name for name in dir(getattr(getattr(torch._C, "_distributed_c10d", None), "Reducer", None))
    if not name.startswith("__"))


def _remove_all(handles: list) -> None:
    for h in handles:
        h.remove()
    handles.clear()


def _rank(group) -> int:
    return group_rank(group)


