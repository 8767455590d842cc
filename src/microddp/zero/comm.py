"""The collectives ZeRO needs, on one bucket at a time, counting the bytes each rank sends.

A bucket travels as its parameters end to end, each rank owning a contiguous part of it.
When every rank is on this host (collectives/route.py's `intra_host_path`), gradients are
reduce-scattered and the updated parameters all-gathered in one shared-memory call each
(shm/collectives.py): one synchronisation per bucket each way, a shorter part padded to the
longest. Elsewhere (other hosts, NCCL, MICRODDP_TRANSPORT=gloo) they go as one reduce per
rank, of that rank's part, to it, and one broadcast per rank, of its part, from it: torch's
reduce_scatter and all_gather would need equal padded chunks and copies, and took longer on
gloo (docs/09-zero.md has the measurements). Float sums on 3+ ranks may differ in their last
bits between the two paths (tests/test_zero_exact.py holds both to the single process).

Bytes are counted per call on the sending rank (`Sent`), so a test checks the ZeRO paper's
arithmetic against what went out; through shared memory, what a rank "sends" is what the
others read out of its slot. `trace_when_done` puts a bucket's collectives on the
communication track while spans are recorded, as DDP's reducer does for its all-reduces.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import comms, spans
from ..collectives.cost import ring_all_reduce_bytes
from ..collectives.route import intra_host_path
from ..shm import collectives as shm
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


class CountingAllReduce(Sent):
    """A DDP comm hook (torch's contract, for microddp's DDP and torch's) that averages a
    bucket with all_reduce and counts what a ring sends for it (cost.ring_all_reduce_bytes).
    `last_step` holds the count since the previous `end_step()`."""

    def __call__(self, _state, bucket):
        import torch.distributed as dist

        flat = bucket.buffer()
        n = dist.get_world_size()
        self.add_bytes(ring_all_reduce_bytes(flat.numel(), n, flat.element_size()))
        flat.div_(n)
        return dist.all_reduce(flat, async_op=True).get_future().then(lambda f: f.value()[0])


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
    if spans.enabled() and handles:
        spans.add_when_done([h.get_future() for h in handles], name, launched, **args)
