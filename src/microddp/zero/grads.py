"""Gradient sharding: each bucket's gradients are reduce-scattered into the owners' shards.

Every stage reduces during backward: a post-accumulate-grad hook counts each bucket's ready
gradients and starts the bucket's reduce-scatter as soon as the last one arrives,
asynchronously, so the communication runs while backward computes the earlier layers (as
DDP's buckets do). Packing a bucket writes the rank's own part (averaged: divided by N on
the way in) straight into its shard gradient, which the reduce to this rank then sums into, and
the other ranks' parts into a buffer that is released as soon as its reduces complete (see
`peak_packed_bytes`). ZeRO-2 and ZeRO-3 drop a bucket's full gradients once packed, so no rank
holds the whole model's gradient at once unless every bucket is still in flight; ZeRO-1 keeps
them (its gradients are not sharded, only its optimizer state). One end-of-backward callback
waits for every bucket.
Traced, each bucket's reduce is a "reduce-scatter bucket k" span on the communication track
and the end-of-backward wait a "wait comm" span, named as DDP's reducer names its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from .. import spans
from .comm import Sent, free_when_sent, reduce_to_owners, trace_when_done
from .flat import pack
from .plan import Bucket, ShardPlan
from .shards import Shards


class GradReducer:
    """Reduce-scatters buckets of `params`' gradients into `shards`."""

    def __init__(self, plan: ShardPlan, params: Sequence[torch.Tensor], shards: Shards,
                 sent: Sent, on_reduced: Callable[[Bucket], None] | None = None,
                 keep_grads: bool = False) -> None:
        self.plan, self.params, self.shards, self.sent = plan, list(params), shards, sent
        self.keep_grads = keep_grads  # ZeRO-1: the full gradients stay in .grad
        self.on_reduced = on_reduced  # ZeRO-3 frees a layer once its gradients are sent
        self.sync = True  # False inside no_sync(): gradients accumulate locally
        self.on_end: Callable[[], None] | None = None  # ZeRO-3 frees what is still gathered
        self.on_start: Callable[[], None] | None = None  # a synchronized backward begins
        self._bucket_of = {p: b.index for b in plan.buckets for p in b.params}
        self._pending: list[tuple[Bucket, list, torch.futures.Future, torch.Tensor | None]] = []
        self._in_flight: list[torch.Tensor] = []
        self._peak = 0
        # The most bytes of packed gradients (other ranks' parts, waiting to be sent) this rank
        # held at once during the last backward: measured from their storages, not computed.
        self.peak_packed_bytes = 0
        self._reset()

    def _reset(self) -> None:
        self._ready = [0] * len(self.plan.buckets)
        self._launched = [False] * len(self.plan.buckets)
        self._queued = False

    def launch(self, bucket: Bucket) -> None:
        """Start reducing `bucket`; its parameters' full gradients are freed at once (unless
        kept: ZeRO-1)."""
        self._launched[bucket.index] = True
        grads = [None] * len(self.params)
        for i in bucket.params:
            grads[i] = self.params[i].grad
        if bucket.numel:
            rank = self.shards.rank
            own, add_after = self.shards.grad_target(bucket, replace=self.keep_grads)
            rest = own.new_empty(bucket.numel - bucket.sizes[rank])
            # Divided before the sum, as DDP does: one pass, and no division after the wait.
            pack(bucket, rank, grads, own, rest, 1.0 / self.plan.world_size)
            # Measured before the reduce starts: a fast one (shared memory) may complete, and
            # release `rest`, before this thread looks again.
            self._track(rest)
            launched = time.perf_counter()
            handles = reduce_to_owners(bucket, own, rest, rank, self.sent)
            trace_when_done(handles, f"reduce-scatter bucket {bucket.index}", launched,
                            bucket=bucket.index, bytes=bucket.numel * own.element_size())
            self._pending.append((bucket, handles, free_when_sent(handles, rest),
                                  own if add_after else None))
        if not self.keep_grads:
            for i in bucket.params:
                self.params[i].grad = None
        if self.on_reduced is not None:
            self.on_reduced(bucket)

    def _track(self, rest: torch.Tensor) -> None:
        # The packed buffers still allocated, measured now that one more was made (the only
        # moment their total grows): the most this backward held beyond the shard gradient.
        self._in_flight = [t for t in self._in_flight if t.untyped_storage().nbytes()] + [rest]
        held = sum(t.untyped_storage().nbytes() for t in self._in_flight)
        self._peak = max(self._peak, held)

    def wait(self) -> None:
        """Wait for every started bucket (its averaged part is in the shard gradient, or is
        added to it now)."""
        t0 = time.perf_counter()
        for bucket, handles, freed, extra in self._pending:
            for handle in handles:
                handle.wait()
            freed.wait()
            if extra is not None:
                self.shards.add_grad(bucket, extra)
        if self._pending and spans.enabled():
            spans.add_span("wait comm", t0, time.perf_counter(), track="comm_wait")
        self._pending.clear()
        self.peak_packed_bytes, self._peak, self._in_flight = self._peak, 0, []

    def attach_hooks(self) -> list:
        """Reduce each bucket during backward, as soon as it is complete."""
        return [p.register_post_accumulate_grad_hook(self._make_hook(i))
                for i, p in enumerate(self.params)]

    def _make_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            if not self.sync:
                return
            if not self._queued:
                self._queued = True
                if self.on_start is not None:
                    self.on_start()
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            b = self._bucket_of[i]
            self._ready[b] += 1
            if self._ready[b] == len(self.plan.buckets[b].params):
                self.launch(self.plan.buckets[b])
        return hook

    def _end_of_backward(self) -> None:
        # A parameter this backward did not reach still owes its bucket: send zeros for it,
        # in bucket order, so every rank issues the same collectives.
        for bucket in self.plan.buckets:
            if not self._launched[bucket.index]:
                self.launch(bucket)
        self.wait()
        self._reset()
        if self.on_end is not None:
            self.on_end()
