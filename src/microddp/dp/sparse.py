"""Sparse gradients (nn.Embedding / nn.EmbeddingBag with sparse=True), averaged as torch's DDP
averages them.

A sparse gradient (the rows a batch touched, and their indices) does not fit a flat dense
bucket. torch's reducer gives each such parameter a bucket of its own, divides its gradient by
the world size and all-reduces the sparse tensor itself: gloo gathers every rank's indices and
values and sums them. The same here, with the same collective, so the averages are torch's bit
for bit; the parameters are kept out of the dense Reducer's buckets. Their all-reduces start
when backward ends, in parameter order on every rank (the dense buckets go during backward, as
always): no overlap for them, and no comm hook (refused at registration, with what to do).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..comms import distributed, group_size


def sparse_parameters(module: nn.Module) -> set[nn.Parameter]:
    """The parameters whose gradients come sparse: torch's rule (expect_sparse_gradient) is an
    Embedding or EmbeddingBag built with sparse=True."""
    return {p for m in module.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
            and m.sparse for p in m.parameters(recurse=False)}


class SparseGrads:
    """Averages the gradients of `params` (sparse ones) over `group` at the end of a backward
    that a syncing forward prepared (`prepare_for_backward`)."""

    def __init__(self, params: Sequence[nn.Parameter], names: Sequence[str], group=None) -> None:
        self.params, self.names, self.group = list(params), list(names), group
        self.expect = self.queued = False
        me = weakref.ref(self)
        self.handles = [p.register_post_accumulate_grad_hook(lambda _p: _ready(me))
                        for p in self.params]
        weakref.finalize(self, _remove_all, self.handles)

    def prepare_for_backward(self) -> None:
        """The next backward averages these gradients (a syncing forward ran)."""
        self.expect = True

    def ready(self) -> None:
        """A sparse gradient is in: average them all when this backward ends."""
        if self.expect and not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    def finish(self) -> None:
        """Divide each gradient by the world size, then sum it over ranks in place (gloo's
        sparse all-reduce writes the summed indices and values into the tensor). A parameter
        this rank did not reach sends an empty gradient, so no rank waits for it."""
        self.expect = self.queued = False
        n = group_size(self.group)
        for p in self.params:
            if p.grad is None:
                p.grad = _empty_like(p)
            p.grad.div_(n)
            if distributed(self.group):
                dist.all_reduce(p.grad, group=self.group)


def _empty_like(p: torch.Tensor) -> torch.Tensor:
    """A sparse gradient of `p`'s shape with no rows (an embedding's: one sparse dimension)."""
    return torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.int64, device=p.device),
                                   torch.empty(0, *p.shape[1:], dtype=p.dtype, device=p.device),
                                   p.shape)


def _ready(me: weakref.ref) -> None:
    s = me()
    if s is not None:
        s.ready()


def _remove_all(handles: list) -> None:
    for h in handles:
        h.remove()
    handles.clear()
