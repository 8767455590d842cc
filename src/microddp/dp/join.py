"""Uneven inputs: `with ddp.join():` lets a rank that has run out of batches keep answering
the collectives of the ranks still training (with zero gradients), so nobody waits forever.

Protocol (ours; every rank runs the same code): before each forward, a rank still training
all-reduces a small tensor saying "I am active" and "this backward will sync". A rank that
has left its loop all-reduces "not active" instead and, while anyone is active, repeats
whatever the active ranks do: bucket rebuild, buffer broadcast, one all-reduce per bucket.
When nobody is active, everyone takes the parameters of a rank that was active to the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

from ..comms import distributed, group_rank, group_size
from ..errors import MicroDDPError
from .comm_hooks import Summing, finish, start_reduction
from .sync import broadcast_coalesced, sync_module_states


class ShadowedReducer(Protocol):
    """What a join needs of the Reducer: its buckets to answer with zeros, and the two state
    changes the Reducer makes itself (the divisor, an iteration this rank did not run)."""

    buckets: list
    params: Sequence[torch.Tensor]
    group: object
    comm_hook: object
    comm_state: object
    world_size: int

    def rebuild_buckets(self) -> None:
        """Regroup buckets in the order gradients arrived (after the first iteration)."""

    def claim(self, bucket, exclusive: bool = False) -> None:
        """Make `bucket` safe to write before this backward's first write into it."""
    def all_reduces_used(self) -> bool:
        """Whether this iteration all-reduces the used-parameter mask (find_unused_parameters)."""

    def set_divisor(self, n: int) -> None:
        """Divide summed gradients by `n` instead of the world size."""
    def skip_iteration(self) -> None:
        """Forget this iteration's state without reducing anything."""


class Joinable(Protocol):
    """What a join needs of the DDP model (ddp.py): its group and devices, its reducer, whose
    rank is the source of parameters and buffers, and whether this forward syncs buffers. A
    Protocol, so join.py and ddp.py do not import each other."""

    process_group: object
    device: torch.device
    module: torch.nn.Module
    reducer: ShadowedReducer
    forward_sync_buffers: bool
    require_forward_param_sync: bool
    _join: object  # the join in force, which each forward reports to

    def src_rank(self, group_rank: int = 0) -> int:
        """The global rank of group rank `group_rank`."""

    def will_sync_buffers(self) -> bool:
        """Whether this forward broadcasts buffers."""


class Join:
    """Context manager returned by `DistributedDataParallel.join()`."""

    def __init__(self, ddp: Joinable, divide_by_initial_world_size: bool = True,
                 enable: bool = True, throw_on_early_termination: bool = False) -> None:
        self.ddp, self.divide_by_initial = ddp, divide_by_initial_world_size
        self.enable = enable and distributed()
        self.throw = throw_on_early_termination
        group = ddp.process_group
        self.size = group_size(group) if self.enable else 1
        self.rank = group_rank(group) if self.enable else 0

    def __enter__(self) -> Join:
        if self.enable:
            self.ddp._join = self
        return self

    def _exchange(self, active: bool, sync: bool) -> tuple[int, int, int]:
        """All-reduce (active flags per rank, sync votes): how many are active, how many will
        sync gradients, and the highest active rank (the buffers' source)."""
        t = torch.zeros(self.size + 1, dtype=torch.int64, device=self.ddp.device)
        t[self.rank] = int(active)
        t[self.size] = int(active and sync)
        dist.all_reduce(t, group=self.ddp.process_group)
        *flags, n_sync = t.tolist()  # one read: on a GPU each read waits for the device
        top = max((r for r, f in enumerate(flags) if f), default=-1)
        return sum(flags), n_sync, top

    def notify(self, grad_sync: bool) -> int:
        """Called by an active rank before each forward; returns the buffers' source rank."""
        n_active, _, top = self._exchange(True, grad_sync)
        if self.throw and n_active < self.size:
            raise MicroDDPError(f"{self.size - n_active} rank(s) ran out of data first "
                                "(throw_on_early_termination=True); give every rank the same "
                                "number of batches, or drop throw_on_early_termination")
        self.ddp.reducer.set_divisor(self.size if self.divide_by_initial else n_active)
        return self.ddp.src_rank(top)

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.ddp._join = None
        if not self.enable or exc_type is not None:
            return False
        shadowed = 0
        while True:
            n_active, n_sync, top = self._exchange(False, False)
            if n_active == 0:
                break
            if self.throw:
                raise MicroDDPError("this rank ran out of data before the others "
                                    "(throw_on_early_termination=True)")
            shadowed += 1
            self.shadow(n_sync, top)
        self.finish(last=shadowed == 0)
        return False

    def shadow(self, n_sync: int, top: int) -> None:
        """Repeat one iteration of the active ranks' collectives (this rank has no data)."""
        ddp, reducer = self.ddp, self.ddp.reducer
        reducer.rebuild_buckets()
        if ddp.will_sync_buffers():
            broadcast_coalesced(list(ddp.module.buffers()), ddp.src_rank(top), ddp.process_group,
                                keep_versions=True)
        ddp.require_forward_param_sync = n_sync > 0
        if n_sync:
            shadow_backward(reducer)

    def finish(self, last: bool) -> None:
        """Every rank is done: all take the parameters of the highest rank that trained to the
        end (`last`: this rank never had to shadow)."""
        ddp = self.ddp
        ddp.reducer.set_divisor(ddp.reducer.world_size)
        mine = torch.tensor([self.rank if last else -1], device=ddp.device)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=ddp.process_group)
        sync_module_states(ddp.module, ddp.src_rank(int(mine.item())), ddp.process_group,
                           buffers=ddp.forward_sync_buffers)


class TorchJoinHook(JoinHook):
    """What torch's generic context manager, `torch.distributed.algorithms.join.Join([model,
    ...])`, runs on a rank out of data: the same shadowing as `ddp.join()`. torch's Join adds
    its own all-reduce per iteration (`Join.notify_join_context`, in our forward)."""

    def __init__(self, join: Join) -> None:
        self.join = join

    def main_hook(self) -> None:
        """Shadow one iteration of the ranks still training (torch's Join calls this while one
        is)."""
        _, n_sync, top = self.join._exchange(False, False)  # someone is active: torch's Join
        self.join.shadow(n_sync, top)                       # calls this only then

    def post_hook(self, is_last_joiner: bool) -> None:
        """Finish the join once every rank is out of data: resync parameters from the last
        joiner."""
        self.join.finish(last=is_last_joiner)


def shadow_backward(reducer: ShadowedReducer) -> None:
    """Issue the same collectives as a real backward would, in the same order, with zeros."""
    futures = []
    for bucket in reducer.buckets:
        reducer.claim(bucket, exclusive=True)  # it may be this rank's .grad: never zero that
        bucket.flat.zero_()
        futures.append(start_reduction(bucket, len(reducer.buckets), reducer.group,
                                       reducer.comm_hook, reducer.comm_state))
    if reducer.all_reduces_used():
        used = torch.zeros(len(reducer.params), dtype=torch.int32, device=reducer.params[0].device)
        futures.append(Summing(used, reducer.group))
    for fut in futures:
        finish(fut)
    reducer.skip_iteration()
