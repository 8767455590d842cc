"""The collectives ZeRO needs, on one bucket at a time, counting the bytes each rank sends.

A bucket travels as its parameters end to end, each rank owning a contiguous part of it.
Gradients are reduce-scattered as one all-to-all: every rank sends each owner its part (and
keeps its own), and the owner sums the N contributions itself. The updated parameters come
back as one broadcast per rank, of its part, from it. Both move the bytes a ring
reduce-scatter and all-gather move, and are counted as sent, per rank: in the all-to-all a
rank sends each of the `N - 1` others its slot (`cap` elements: its part, padded by at most
one element so that every slot is equal), in the broadcasts its own part to the `N - 1`
others.

Why these and not others, timed bare on gloo with 8 MiB, interleaved, the slowest rank's
median (load average 6 to 7 on 2 cores): on 2 ranks, the all-to-all took 5.6 ms where one
reduce per rank (each rank's part to it) took 12.2 ms, as long as an all-reduce of the whole
buffer (11.1 ms: gloo's reduce moves as much as an all-reduce), and reduce_scatter_tensor
26 ms; on 4 ranks 10.0, 17.8, 20.2 and 46 ms. One broadcast per rank took 4.0 ms (4 ranks
8.9) where all_gather took 11.1 (16.3); all_gather also needs equal (padded) chunks and
copies in and out of them. The price of the all-to-all: a receive buffer of N slots (about
the bucket's size) while the bucket is in flight, freed at the end of backward with the
bucket itself.

Counted per call, on the sending rank, so a test can check the ZeRO paper's arithmetic (2x
the parameter bytes per step for ZeRO-1/2, 3x for ZeRO-3) against what actually went out
rather than against a formula.

While spans are recorded (`--trace`), `trace_when_done` puts each bucket's or layer's
collectives on the communication track, from launch to the completion of the last of them,
as DDP's reducer does for its all-reduces; when nothing records it costs one check.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import comms
from .. import spans as trace
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


def reduce_to_owners(bucket: Bucket, slots: torch.Tensor, rank: int,
                     sent: Sent) -> tuple[list, torch.Tensor]:
    """Start sending each rank its slot of `slots` (the bucket's gradients, packed by
    flat.pack_slots), one all-to-all. Returns the handles and `parts`, N rows of `sizes[rank]`
    elements: once the handles are waited, row r is rank r's contribution to this rank's
    elements, and their sum over rows is this rank's part of the reduced bucket."""
    n, own, cap = bucket.world_size, bucket.sizes[rank], bucket.cap
    sent.add_bytes((n - 1) * cap * slots.element_size())
    if n == 1:
        return [], slots.view(1, -1)
    out = torch.empty(n * cap, dtype=slots.dtype, device=slots.device)
    work = dist.all_to_all_single(out, slots, async_op=True)
    return [comms.Handle(work)], out.view(n, cap)[:, :own]


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


def trace_when_done(handles: Sequence, name: str, launched: float, **args) -> None:
    """While spans are recorded: record `name` on the communication track from `launched` to
    when the last of `handles` completes (seen by the backend's callback, not by a later wait,
    so the span ends when the bytes arrived and the overlap figures count it right). The span
    belongs to the step it was launched in, even if the callback runs after the next began."""
    rec = trace.recorder()
    if rec is None or not handles:
        return
    step, left, lock = rec.step, [len(handles)], threading.Lock()

    def done(_fut) -> None:
        with lock:  # the callbacks of different collectives may run on different threads
            left[0] -= 1
            last = left[0] == 0
        if last:
            rec.add(trace.Span(name, launched, time.perf_counter(), "comm", step, args))

    for handle in handles:
        handle.get_future().add_done_callback(done)
