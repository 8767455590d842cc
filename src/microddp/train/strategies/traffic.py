"""Bytes a rank sends to average gradients, counted from the gradients it averages.

An engine's all-reduce is gloo's (or NCCL's), whose wire we cannot read, so the count is per
synchronised backward, from the live gradient tensors: a ring all-reduce of N elements over n
ranks sends 2 (n - 1) chunks of ceil(N / n) elements from every rank (a reduce-scatter, then an
all-gather), the same rule zero/comm.py and zero.CountingAllReduce count ZeRO's and DDP's
collectives by, so the strategies' `sent_per_step` compare.
"""

from __future__ import annotations

from torch import nn


def ring_all_reduce_bytes(module: nn.Module, n: int) -> int:
    """What this rank sends to average `module`'s gradients over `n` ranks, in one bucket."""
    grads = [p.grad for p in module.parameters() if p.requires_grad and p.grad is not None]
    if n < 2 or not grads:
        return 0
    numel = sum(g.numel() for g in grads)
    return 2 * (n - 1) * -(-numel // n) * grads[0].element_size()
