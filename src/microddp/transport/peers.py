"""What every algorithm shares: the group as a list of peers, point-to-point calls, reductions.

Algorithms think in group ranks 0..p-1 (a ring is `me + 1 mod p`); `Peers` turns them into
calls on the process group, so the same code runs on the default group and on any sub-group.
Only point-to-point operations are used here: that is the whole point of this package.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.autograd.graph import increment_version

from ..errors import MicroDDPError
from ..world.world import distributed, uses_nccl

# In-place reductions: acc = op(acc, other). avg sums, and the caller divides once at the end.
COMBINE: dict[str, Callable[[torch.Tensor, torch.Tensor], object]] = {
    "sum": lambda acc, x: acc.add_(x),
    "avg": lambda acc, x: acc.add_(x),
    "product": lambda acc, x: acc.mul_(x),
    "min": lambda acc, x: torch.minimum(acc, x, out=acc),
    "max": lambda acc, x: torch.maximum(acc, x, out=acc),
    "band": lambda acc, x: acc.bitwise_and_(x),
    "bor": lambda acc, x: acc.bitwise_or_(x),
    "bxor": lambda acc, x: acc.bitwise_xor_(x),
}


class Traffic:
    """What this process sent through the algorithms: messages and bytes (see `traffic()`)."""

    def __init__(self):
        self.messages = 0
        self.bytes = 0

    def __repr__(self) -> str:
        return f"Traffic(messages={self.messages}, bytes={self.bytes})"


_counters: list[Traffic] = []


@contextmanager
def traffic() -> Iterator[Traffic]:
    """Count the messages and bytes this rank sends inside the block.

        with traffic() as sent:
            ring_all_reduce(t)
        print(sent.bytes)      # 2 (p-1)/p * t's bytes, for any p
    """
    counter = Traffic()
    _counters.append(counter)
    try:
        yield counter
    finally:
        _counters.remove(counter)


def _count(tensor: torch.Tensor) -> None:
    for c in _counters:
        c.messages += 1
        c.bytes += tensor.numel() * tensor.element_size()


# A group's rank, size and backend never change while it lives; asking torch.distributed for
# them costs about 6 us per collective, all of it before the first send. Keyed weakly, so a
# destroyed group's entry goes with it (and a new group is a new key).
_facts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Peers:
    """This process's view of a group: its size, its own rank in it, and p2p calls by group rank."""

    def __init__(self, group=None):
        self.group = group
        self.back = None  # on 2 ranks, a second group for messages from rank 1 to 0 (transport/duplex.py)
        self.alone = not distributed()  # asked once: a Peers lives inside one group
        if self.alone:
            self.size, self.me, self.pg, self.nccl = 1, 0, None, False
            return
        self.pg = group if group is not None else dist.group.WORLD
        # Off the group, new_group() hands out a plain int: nothing to key on, nothing to cache.
        cacheable = isinstance(self.pg, dist.ProcessGroup)
        facts = _facts.get(self.pg) if cacheable else None
        if facts is None:
            me = dist.get_rank(group)  # -1 if this process is not a member
            facts = (me, dist.get_world_size(group) if me >= 0 else 0,
                     me >= 0 and uses_nccl(group))
            if cacheable:
                _facts[self.pg] = facts
        self.me, self.size, self.nccl = facts

    @property
    def member(self) -> bool:
        """Whether this rank belongs to the group."""
        return self.me >= 0

    def group_rank(self, global_rank: int, what: str) -> int:
        """The group rank of a global `src`/`dst`, with an error naming the members if absent."""
        if self.alone:
            if global_rank != 0:
                raise MicroDDPError(f"{what}={global_rank}, but a world of one process has only "
                                    "rank 0")
            return 0
        ranks = dist.get_process_group_ranks(self.pg)
        if global_rank not in ranks:
            raise MicroDDPError(f"{what}={global_rank} is not a member of the group (global "
                                f"ranks {ranks}); pass a global rank from that list")
        return ranks.index(global_rank)

    def global_rank(self, group_rank: int) -> int:
        """The global rank of group rank `group_rank` (it must be one)."""
        if self.alone:
            return group_rank
        return dist.get_process_group_ranks(self.pg)[group_rank]

    # The process group's own send/recv take group ranks: no translation on the hot path.
    # Tags tell apart the messages of consecutive steps between the same two ranks; NCCL
    # ignores them (its messages match in order), gloo is much faster with them: with one tag
    # for every step, a receive posted early can stall for milliseconds on a busy machine.
    # With a second connection (`back`), messages from the higher group rank go over it.
    def isend(self, tensor: torch.Tensor, peer: int, tag: int = 0):
        """Start sending `tensor` to group rank `peer`; the work to wait on."""
        if _counters:
            _count(tensor)
        pg = self.back if self.back is not None and peer < self.me else self.pg
        return pg.send([_wire(tensor)], peer, 0 if self.nccl else tag)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int = 0):
        """Start receiving into `tensor` from group rank `peer`; the work to wait on."""
        pg = self.back if self.back is not None and peer > self.me else self.pg
        return pg.recv([_wire(tensor)], peer, 0 if self.nccl else tag)

    def isend_main(self, tensor: torch.Tensor, peer: int, tag: int = 0):
        """isend on the group's own connection, even to a lower rank when there is a second
        one: where every collective's agreement travels (agreement/carried.py)."""
        if _counters:
            _count(tensor)
        return self.pg.send([tensor], peer, tag)

    def irecv_main(self, tensor: torch.Tensor, peer: int, tag: int = 0):
        """irecv on the group's own connection (see isend_main)."""
        return self.pg.recv([tensor], peer, tag)

    def send(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> None:
        """Send `tensor` to group rank `peer` and wait until it is sent."""
        self.isend(tensor, peer, tag).wait()

    def recv(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> None:
        """Receive into `tensor` from group rank `peer` and wait until it has arrived."""
        self.irecv(tensor, peer, tag).wait()

    def exchange(self, send: torch.Tensor | None, dst: int, recv: torch.Tensor | None,
                 src: int, tag: int = 0) -> list:
        """Start a send to `dst` and a receive from `src` together; return the works to wait on.

        NCCL needs the pair posted as one batch (else two ranks that both send first can block
        each other on their streams); gloo sends and receives independently, and is faster
        when the send goes first.
        """
        if self.nccl:
            ops = []
            ranks = dist.get_process_group_ranks(self.pg)
            if recv is not None and recv.numel():
                ops.append(dist.P2POp(dist.irecv, _wire(recv), ranks[src], self.group))
            if send is not None and send.numel():
                if _counters:
                    _count(send)
                ops.append(dist.P2POp(dist.isend, _wire(send), ranks[dst], self.group))
            return dist.batch_isend_irecv(ops) if ops else []
        works = []
        if send is not None and send.numel():
            works.append(self.isend(send, dst, tag))
        if recv is not None and recv.numel():
            works.append(self.irecv(recv, src, tag))
        return works


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def wait_all(works: list) -> None:
    """Wait for every work in `works`, in order."""
    for w in works:
        w.wait()


class Flat:
    """A 1-D contiguous view of `tensor` to work on; `done()` writes it back if it was a copy.

    Non-contiguous tensors (a transposed matrix, a strided slice) cannot go on the wire as they
    are, so the algorithm works on a packed copy and the result is copied back in place.
    """

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        # Detached: autograd forbids writing in place into a tensor that requires grad (a
        # parameter), and a collective is no step it could differentiate. The detached tensor
        # shares the memory and the version counter (cheaper than entering torch.no_grad()).
        self.base = tensor.detach()
        self.in_place = self.base.is_contiguous()
        self.packed = self.base if self.in_place else self.base.contiguous()
        self.data = self.packed.view(-1)

    def done(self) -> torch.Tensor:
        """Write the result back into the original tensor if it was packed, and return it."""
        if not self.in_place:
            self.base.copy_(self.packed)
        written(self.tensor)
        return self.tensor


def written(tensor: torch.Tensor) -> None:
    """Tell autograd that `tensor` changed in place. Receives (torch's, so ours too) and the
    ring's kept views write its memory without autograd seeing it; a backward through a value
    saved before the write would then compute a wrong gradient instead of raising."""
    increment_version(tensor)


_scratch: dict[tuple, torch.Tensor] = {}


def scratch(purpose: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reusable 1-D buffer of at least `numel` elements, kept between calls.

    Fresh memory for every call is not free: a 32 MiB buffer is 8192 pages the kernel must
    fault in and zero. Each `purpose` has its own buffer, so two users never share one.
    """
    key = (purpose, dtype, device)
    buf = _scratch.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        _scratch[key] = buf
    return buf[:numel]


def bounds(numel: int, parts: int) -> list[int]:
    """Offsets splitting `numel` elements into `parts` near-equal chunks (some may be empty)."""
    return [i * numel // parts for i in range(parts + 1)]
