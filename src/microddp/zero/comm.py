"""The collectives ZeRO needs, on one bucket at a time, counting the bytes each rank sends.

A bucket travels as its parameters end to end, each rank owning a contiguous part of it.
When every rank is on this host (microddp's shared memory, collectives/shm.py, chosen by
collectives/route.py's `intra_host_path`: gloo backend, a dtype and device it carries, not
MICRODDP_TRANSPORT=gloo), gradients are reduce-scattered in one shared-memory reduce-scatter
and the updated parameters come back in one shared-memory all-gather: one synchronisation of
the ranks per bucket each way (per 4 MiB slot), where gloo took N calls. Those take equal
parts; ours differ by at most one element, so a shorter part travels as a copy padded to the
longest (none when N divides the bucket). Shared memory adds the ranks' values in rank order,
gloo's reduce in an order of its own: the last bits of a float sum on 3+ ranks may differ
between the two paths (tests/test_zero_exact.py holds both to the single process). Measured
(`microddp bench zero --ranks 2 4 --contenders zero1 torch-zero1 torch-zero1-again
--repeats 40`, load average 3 to 9 on 2 cores), ZeRO-1 against torch's ZeroRedundancyOptimizer
went from 0.92x and 0.94x (2 ranks) and 0.86x and 1.01x (4 ranks) with MICRODDP_TRANSPORT=gloo
(two runs) to 0.74x-0.86x and 0.70x-0.77x (four runs, every 90% interval below 1) (docs/09-zero.md).

Elsewhere (other hosts, NCCL, MICRODDP_TRANSPORT=gloo), gradients are reduce-scattered as one
reduce per rank, of that rank's part, to that rank; the parameters come back as one
broadcast per rank, of its part, from it. Why not torch's reduce_scatter and all_gather there:
they need equal (padded) chunks and copies in and out of them, and on gloo, timed bare on
8 MiB (2 and 4 ranks, interleaved, load average 10 to 12 on 2 cores), reduce_scatter took
1.1x to 1.7x the time of one async reduce per rank, and all_gather 1.7x to 3x that of one
async broadcast per rank. (One all-to-all of equal slots instead of the per-rank reduces was
measured too: 5.6 against 12.2 ms bare on 8 MiB, 2 ranks, yet 1.08x and 1.26x the step time
of ZeRO-1 with per-rank reduces, interleaved; so not used.)

Bytes are counted per call, on the sending rank, so a test can check the ZeRO paper's
arithmetic (2x the parameter bytes per step for ZeRO-1/2, 3x for ZeRO-3, times (N-1)/N)
against what went out rather than against a formula. Through gloo a rank sends the others
their parts in the reduces (`numel - own` elements) and its own part to the `N - 1` others in
the broadcasts. Through shared memory, what a rank "sends" is what the other ranks read out
of its slot: in the reduce-scatter each of the `N - 1` others reads its (padded) part, in the
all-gather each reads this rank's padded part: `(N - 1) * longest part` elements each way,
the same bytes up to the padding.

While spans are recorded (`--trace`), `trace_when_done` puts each bucket's or layer's
collectives on the communication track, from launch to the completion of the last of them,
as DDP's reducer does for its all-reduces; when nothing records it costs one check.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import comms
from .. import spans as trace
from ..collectives import shm
from ..collectives.route import intra_host_path
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


def shared_memory(tensor: torch.Tensor, group=None) -> bool:
    """Whether this bucket's collectives go through the host's shared memory: the world's
    ranks all share this host and may use it (decided once, collectively, on the first
    call: every rank asks at the same point, its first bucket), and it carries this tensor's
    dtype and device; else they go through the backend (gloo, NCCL), one call per rank."""
    return intra_host_path(tensor, "sum", group) is not None


class _Then:
    """A collective's handle whose result still needs `after` (a copy out of padding): waits
    run `after` first, and its future completes only once `after` has run."""

    def __init__(self, work, after) -> None:
        self._future = work.get_future().then(lambda _done: after())

    def wait(self) -> bool:
        self._future.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future


def _padded(view: torch.Tensor, cap: int) -> torch.Tensor:
    """`view` itself if it has `cap` elements, else a copy of it padded with zeros to `cap`
    (shared memory's reduce-scatter and all-gather take equal parts; ours differ by at most
    one element, so at most N - 1 parts of a bucket are copied, none when N divides it)."""
    if view.numel() == cap:
        return view
    out = view.new_zeros(cap)
    out.narrow(0, 0, view.numel()).copy_(view)
    return out


def reduce_to_owners(bucket: Bucket, own: torch.Tensor, rest: torch.Tensor, rank: int,
                     sent: Sent, group=None) -> list:
    """Start summing the bucket's gradients (packed by flat.pack into `own`, this rank's part,
    and `rest`, the others') over ranks, each rank's part into that rank's `own` only: one
    shared-memory reduce-scatter on one host, else one reduce per rank that owns any. Returns
    the handles; once waited, `own` holds this rank's sum (`rest` is left unspecified).
    `group`: the process group (ranks are its group ranks), the world's by default."""
    handles = []
    if shared_memory(own, group):
        cap = max(bucket.sizes)
        inputs = [_padded(part(bucket, r, rank, own, rest), cap)
                  for r in range(bucket.world_size)]
        out = inputs[rank]
        # Looked up at the call, not bound at import: the hang monitor wraps it while it runs.
        work = shm.shm_reduce_scatter(out, inputs, op="sum", group=group, async_op=True)
        handles.append(work if out is own else _Then(work, lambda: own.copy_(out[:own.numel()])))
        sent.add_bytes((bucket.world_size - 1) * cap * own.element_size())
        return handles
    for r, size in enumerate(bucket.sizes):
        if size:
            handles.append(comms.reduce(part(bucket, r, rank, own, rest), op="sum",
                                        group=group, group_dst=r, async_op=True))
    sent.add_bytes((bucket.numel - bucket.sizes[rank]) * own.element_size())
    return handles


def broadcast_shards(bucket: Bucket, flat: torch.Tensor, rank: int, sent: Sent,
                     group=None) -> list:
    """Start filling `flat` (the bucket's parameters end to end, this rank's own elements
    already in place) with every rank's elements: one shared-memory all-gather on one host,
    else one broadcast from each rank that owns any. Every rank issues the same calls in the
    same order (ranks of `group`, the world's by default). Returns the handles to wait."""
    handles = []
    parts = [flat.narrow(0, bucket.start(r), size) for r, size in enumerate(bucket.sizes)]
    if shared_memory(flat, group):
        cap = max(bucket.sizes)
        outs = [p if p.numel() == cap else p.new_empty(cap) for p in parts]
        work = shm.shm_all_gather(outs, _padded(parts[rank], cap), group=group, async_op=True)
        short = [(p, o) for p, o in zip(parts, outs, strict=True) if o is not p]

        def unpad() -> None:
            for p, o in short:
                p.copy_(o[:p.numel()])
        handles.append(_Then(work, unpad) if short else work)
        sent.add_bytes((bucket.world_size - 1) * cap * flat.element_size())
        return handles
    for r, size in enumerate(bucket.sizes):
        if size:
            handles.append(comms.broadcast(parts[r], group=group, group_src=r, async_op=True))
    sent.add_bytes((bucket.world_size - 1) * bucket.sizes[rank] * flat.element_size())
    return handles


def all_gather_slots(outs: list[torch.Tensor], send: torch.Tensor, group=None) -> None:
    """outs[r] becomes rank r's equal-sized `send` (fully_shard's units): one shared-memory
    all-gather on one host, else the backend's."""
    if shared_memory(send, group):
        shm.shm_all_gather(outs, send, group=group)
    else:
        comms.all_gather(outs, send, group=group)


def reduce_scatter_slots(out: torch.Tensor, ins: list[torch.Tensor], group=None):
    """Make `out` the sum over ranks of their ins[rank] (fully_shard's units): one
    shared-memory reduce-scatter on one host, started and returned as a handle; else the
    backend's, done before returning None (gloo's reduce-scatter has no future to free its
    input by, and holding every unit's input until the end of backward would hold the whole
    gradient)."""
    if shared_memory(out, group):
        return shm.shm_reduce_scatter(out, ins, op="sum", group=group, async_op=True)
    comms.reduce_scatter(out, ins, op="sum", group=group)
    return None


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
