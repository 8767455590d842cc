"""Bytes a rank sends to average gradients, counted from the gradients it averages.

An engine's all-reduce is gloo's (or NCCL's), whose wire we cannot read, so the count is per
synchronised backward, from the live gradient tensors, by the ring's rule
(collectives/cost.py's ring_all_reduce_bytes, which ZeRO's counters use too), so the
strategies' `sent_per_step` compare.
"""

from __future__ import annotations

from torch import nn

from ...collectives.cost import ring_all_reduce_bytes as ring_bytes


def ring_all_reduce_bytes(module: nn.Module, n: int) -> int:
    """What this rank sends to average `module`'s gradients over `n` ranks, in one bucket."""
    grads = [p.grad for p in module.parameters() if p.requires_grad and p.grad is not None]
    if not grads:
        return 0
    return ring_bytes(sum(g.numel() for g in grads), n, grads[0].element_size())
