"""The collectives ZeRO needs, on one bucket at a time, counting the bytes each rank sends.

The count is what a ring sends (the algorithm gloo's and NCCL's collectives use for large
tensors): for a bucket of `N` slots, `N - 1` slots leave each rank in a reduce-scatter. The
updated parameters go back as one broadcast per rank of its own elements, counted as that rank
sending them to the `N - 1` others: the same bytes in all as a ring all-gather (`N - 1` slots
per rank), but on gloo, `N` broadcasts straight into the parameters' flat buffer take about
half the time of an all-gather into padded slots and the copy out of them (measured in
docs/09-zero.md). Counted per call, on the sending rank, so a test can check the
ZeRO paper's arithmetic (2x the parameter bytes per step for ZeRO-1/2, 3x for ZeRO-3) against
what actually went out rather than against a formula.
"""

from __future__ import annotations

import torch

from .. import comms
from .plan import Bucket


class Sent:
    """Bytes this rank sent through ZeRO's collectives, in total and over the last step."""

    def __init__(self) -> None:
        self.total = 0
        self.last_step = 0
        self._at_step = 0

    def add(self, bucket: Bucket, element_size: int) -> None:
        """Count the bytes one bucket's collective sends from this rank."""
        self.total += (bucket.world_size - 1) * bucket.cap * element_size

    def add_bytes(self, n: int) -> None:
        """Count `n` bytes sent from this rank."""
        self.total += n

    def end_step(self) -> None:
        """Close the step's window: what went out since the previous step ended."""
        self.last_step, self._at_step = self.total - self._at_step, self.total


def reduce_scatter(bucket: Bucket, slots: torch.Tensor, sent: Sent):
    """Start averaging `slots` over ranks; this rank's slot (`cap` elements) arrives in the
    returned tensor once the returned handle is waited."""
    out = torch.empty(bucket.cap, dtype=slots.dtype, device=slots.device)
    sent.add(bucket, slots.element_size())
    handle = comms.reduce_scatter(out, list(slots.chunk(bucket.world_size)), op="avg",
                                  async_op=True)
    return handle, out


def broadcast_shards(bucket: Bucket, flat: torch.Tensor, rank: int, sent: Sent) -> list:
    """Start filling `flat` (the bucket's parameters end to end, this rank's own elements
    already in place) with every rank's elements: one broadcast from each rank that owns any.
    Every rank issues the same calls in the same order. Returns the handles to wait."""
    handles = []
    for r, size in enumerate(bucket.sizes):
        if size:
            part = flat.narrow(0, bucket.start(r), size)
            handles.append(comms.broadcast(part, group_src=r, async_op=True))
    sent.add_bytes((bucket.world_size - 1) * bucket.sizes[rank] * flat.element_size())
    return handles
