"""The collectives ZeRO needs, on one bucket at a time, counting the bytes each rank sends.

A bucket travels as its parameters end to end, each rank owning a contiguous part of it.
Gradients are reduce-scattered as one reduce per rank, of that rank's part, to that rank; the
updated parameters come back as one broadcast per rank, of its part, from it. Both move the
bytes a ring reduce-scatter and all-gather move, and are counted that way, per rank: in the
reduces a rank sends the others their parts (`numel - own` elements), in the broadcasts its
own part to the `N - 1` others. Why not torch's reduce_scatter and all_gather: they need
equal (padded) chunks and copies in and out of them, and on gloo, timed bare on 8 MiB
(2 and 4 ranks, interleaved, load average 10 to 12 on 2 cores), reduce_scatter took 1.1x to
1.7x the time of one async reduce per rank, and all_gather 1.7x to 3x that of one async
broadcast per rank. Counted per call, on the sending rank, so a test can check the ZeRO
paper's arithmetic (2x the parameter bytes per step for ZeRO-1/2, 3x for ZeRO-3) against
what actually went out rather than against a formula. (One all-to-all of equal slots instead
of the per-rank reduces was measured too: 5.6 against 12.2 ms bare on 8 MiB, 2 ranks, yet
1.08x and 1.26x the step time of ZeRO-1 with per-rank reduces, interleaved; so not used.)

While spans are recorded (`--trace`), `trace_when_done` puts each bucket's or layer's
collectives on the communication track, from launch to the completion of the last of them,
as DDP's reducer does for its all-reduces; when nothing records it costs one check.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import comms
from .. import spans as trace
from .flat import part
from .plan import Bucket


class Sent:
    """Bytes this rank sent through ZeRO's collectives, in total and over the last step."""

    def __init__(self) -> None:
        self.total = 0
        self.last_step = 0
        self._at_step = 0

    def add_bytes(self, n: int) -> None:
        """Count `n` bytes sent from this rank."""
        self.total += n

    def end_step(self) -> None:
        """Close the step's window: what went out since the previous step ended."""
        self.last_step, self._at_step = self.total - self._at_step, self.total


def reduce_to_owners(bucket: Bucket, own: torch.Tensor, rest: torch.Tensor, rank: int,
                     sent: Sent) -> list:
    """Start summing the bucket's gradients (packed by flat.pack into `own`, this rank's part,
    and `rest`, the others') over ranks, each rank's part into that rank's `own` only: one
    reduce per rank that owns any. Returns the handles; once waited, `own` holds this rank's
    sum (`rest` is left unspecified)."""
    handles = []
    for r, size in enumerate(bucket.sizes):
        if size:
            handles.append(comms.reduce(part(bucket, r, rank, own, rest), op="sum",
                                        group_dst=r, async_op=True))
    sent.add_bytes((bucket.numel - bucket.sizes[rank]) * own.element_size())
    return handles


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


def free_when_sent(handles: Sequence, buffer: torch.Tensor) -> torch.futures.Future:
    """Release `buffer`'s memory as soon as the last of `handles` (the collectives sending
    it) completes, from the thread that completes it, rather than when someone waits: during
    backward a bucket's packed gradients live only while they travel. Returns the future to
    wait for that release."""
    def release(_done: torch.futures.Future) -> None:
        buffer.untyped_storage().resize_(0)

    return torch.futures.collect_all([h.get_future() for h in handles]).then(release)


def trace_when_done(handles: Sequence, name: str, launched: float, **args) -> None:
    """While spans are recorded: `name` on the communication track from `launched` until the
    last of `handles` completes (spans.add_when_done), in the step it was launched in."""
    if trace.enabled() and handles:
        trace.add_when_done([h.get_future() for h in handles], name, launched, **args)
