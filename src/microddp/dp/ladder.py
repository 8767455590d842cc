"""The data-parallel ladder, one idea per stage; `diff` two neighbours to see that idea.

1. monolith  one process, the whole batch
2. manual    two replicas in one process, half a batch each, gradients averaged by hand
3. naive     real ranks; after backward, one all-reduce per parameter
4. hooks     the all-reduce moves into a hook that fires as soon as each gradient is ready
5. buckets   gradients travel in a few flat buckets (reverse order) instead of one by one
6. overlap   each bucket's all-reduce starts asynchronously; backward waits once, at the end

Every stage leaves the same averaged gradients, so every stage trains to the same parameters.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from .. import comms, spans
from .buckets import Bucket, MiB, plan_buckets

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def toy_data(n: int, dim: int, n_classes: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A reproducible classification batch: Gaussian points labelled by a fixed random rule."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, n_classes, generator=g)
    return x, (x @ w).argmax(dim=1)


def shard(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's contiguous slice of the global batch (equal slices keep the mean exact)."""
    if t.shape[0] % world_size:
        raise ValueError(f"batch of {t.shape[0]} does not split evenly over {world_size} ranks")
    return t.chunk(world_size)[rank]


# 1. monolith ------------------------------------------------------------------------------
# --8<-- [start:monolith]
def monolith_step(model: nn.Module, opt: torch.optim.Optimizer, loss_fn: Loss,
                  x: torch.Tensor, y: torch.Tensor) -> float:
    """One ordinary training step on one process."""
    opt.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()
# --8<-- [end:monolith]


# 2. manual --------------------------------------------------------------------------------
# --8<-- [start:manual]
def manual_step(replicas: Sequence[nn.Module], opts: Sequence[torch.optim.Optimizer],
                loss_fn: Loss, x: torch.Tensor, y: torch.Tensor) -> float:
    """Each replica sees an equal slice of the batch; autograd knows nothing of the others,
    so we average the gradients ourselves before every replica takes the same step."""
    n, losses = len(replicas), []
    for model, opt, xs, ys in zip(replicas, opts, x.chunk(n), y.chunk(n), strict=True):
        opt.zero_grad()
        loss = loss_fn(model(xs), ys)
        loss.backward()
        losses.append(loss.item())
    for params in zip(*(m.parameters() for m in replicas), strict=True):
        mean = torch.stack([p.grad for p in params]).mean(dim=0)
        for p in params:
            p.grad.copy_(mean)
    for opt in opts:
        opt.step()
    return sum(losses) / n
# --8<-- [end:manual]


# 3. naive ---------------------------------------------------------------------------------
# --8<-- [start:naive]
def average_gradients(params: Iterable[nn.Parameter]) -> None:
    """One blocking all-reduce per parameter, after the whole backward pass."""
    for p in params:
        if p.grad is not None:
            comms.all_reduce_mean(p.grad)


def naive_step(model: nn.Module, opt: torch.optim.Optimizer, loss_fn: Loss,
               x: torch.Tensor, y: torch.Tensor) -> float:
    """The monolith step on this rank's slice, plus averaging the gradients over ranks."""
    opt.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    average_gradients(model.parameters())
    opt.step()
    return loss.item()
# --8<-- [end:naive]


# 4. hooks ---------------------------------------------------------------------------------
# --8<-- [start:hooks]
class GradHooks:
    """Average each gradient from a hook, the moment autograd has accumulated it into .grad.

    A post-accumulate-grad hook sees the finished .grad (so accumulation over several backward
    passes stays correct); a tensor hook would run before accumulation, on a partial value.
    With the hooks in place, the training step is the monolith's again.
    """

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self.sync = True  # False inside no_sync(): let gradients accumulate locally
        self.handles = [p.register_post_accumulate_grad_hook(self._hook)
                        for p in params if p.requires_grad]

    def _hook(self, p: nn.Parameter) -> None:
        if self.sync:
            comms.all_reduce_mean(p.grad)

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        for h in self.handles:
            h.remove()
# --8<-- [end:hooks]


# 5. buckets -------------------------------------------------------------------------------
# --8<-- [start:buckets]
class BucketHooks:
    """Like GradHooks, but gradients are copied into flat buckets, one all-reduce per bucket.

    Buckets are filled in reverse parameter order, the order backward produces gradients in,
    so the last layers' bucket fills first.
    """

    def __init__(self, params: Iterable[nn.Parameter], bucket_cap_mb: float = 25) -> None:
        self.sync = True
        params = [p for p in params if p.requires_grad][::-1]
        plan = plan_buckets(params, [int(bucket_cap_mb * MiB)], order=range(len(params)))
        self.buckets = [Bucket([params[i] for i in b], k) for k, b in enumerate(plan)]
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.handles = [p.register_post_accumulate_grad_hook(self._hook) for p in params]

    def _hook(self, p: nn.Parameter) -> None:
        if not self.sync:
            return
        bucket = self.bucket_of[p]
        if bucket.add(p):  # this was the bucket's last gradient
            comms.all_reduce_mean(bucket.flat)
            bucket.copy_out()

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        for h in self.handles:
            h.remove()
# --8<-- [end:buckets]


# 6. overlap -------------------------------------------------------------------------------
# --8<-- [start:overlap]
class OverlapHooks:
    """Like BucketHooks, but a full bucket's all-reduce starts asynchronously and backward
    carries on computing earlier layers' gradients meanwhile; one callback at the end of
    backward waits for every bucket and writes the averages back into .grad."""

    def __init__(self, params: Iterable[nn.Parameter], bucket_cap_mb: float = 25) -> None:
        self.sync = True
        params = [p for p in params if p.requires_grad][::-1]
        plan = plan_buckets(params, [int(bucket_cap_mb * MiB)], order=range(len(params)))
        self.buckets = [Bucket([params[i] for i in b], k) for k, b in enumerate(plan)]
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.handles = [p.register_post_accumulate_grad_hook(self._hook) for p in params]
        self.in_flight: list[tuple[Bucket, comms.Handle, float]] = []
        self.waiting = False

    def _hook(self, p: nn.Parameter) -> None:
        if not self.sync:
            return
        if not self.waiting:  # first gradient of this backward: arrange the final wait
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self.waiting = True
        bucket = self.bucket_of[p]
        if bucket.add(p):
            handle = comms.all_reduce_mean(bucket.flat, async_op=True)
            self.in_flight.append((bucket, handle, time.perf_counter()))

    def _finish(self) -> None:
        t0 = time.perf_counter()
        for bucket, handle, launched in self.in_flight:
            handle.wait()
            bucket.copy_out()
            if spans.enabled():
                spans.add_span(f"allreduce bucket {bucket.index}", launched, time.perf_counter(),
                               track="comm", bucket=bucket.index, bytes=bucket.nbytes)
        if spans.enabled():
            spans.add_span("wait comm", t0, time.perf_counter(), track="comm_wait")
        self.in_flight.clear()
        self.waiting = False

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        for h in self.handles:
            h.remove()
# --8<-- [end:overlap]
