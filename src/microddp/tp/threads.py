"""A test mesh of many ranks in one process: each rank a thread, each group an in-memory exchange.

Two cores cannot run 8 or 16 real ranks in seconds, yet a mesh's composition (TP inside, DP
across; sub-groups made once per dimension) is what goes wrong at that size. `run(n, fn)`
starts n threads, `fn(rank)` each, and `ThreadMesh(dp, tp)` gives every rank its tensor-parallel
and data-parallel `ThreadGroup`, ranks laid out TP innermost (rank = dp_index * tp + tp_index),
as the field does. tp/comm.py sends a ThreadGroup's collectives here instead of through
torch.distributed: the layers run unchanged. Reductions add the ranks' tensors in rank order,
so a result is the same on every rank and on every run; a barrier with a deadline stands in for
the transport, so a rank that never arrives is an error, never a hang. Torch's kernels release
the GIL, so the threads do run side by side.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from ..errors import MicroDDPError

DEADLINE_S = 120.0


class _Room:
    """Where one group's ranks leave their tensors and wait for each other."""

    def __init__(self, n: int) -> None:
        self.slots: list[Any] = [None] * n
        self.barrier = threading.Barrier(n, timeout=DEADLINE_S)


class ThreadGroup:
    """A group of thread ranks: `size`, this thread's `rank` in it, and its collectives."""

    def __init__(self, ranks: list[int], me: int, room: _Room) -> None:
        self.ranks, self.size, self.rank, self._room = ranks, len(ranks), ranks.index(me), room

    def _exchange(self, value) -> list:
        room = self._room
        room.slots[self.rank] = value
        try:
            room.barrier.wait()
            got = list(room.slots)
            room.barrier.wait()  # nobody writes the next call's value before all have read
        except threading.BrokenBarrierError:
            raise MicroDDPError(f"thread rank {self.ranks[self.rank]}: a rank of group "
                                f"{self.ranks} did not arrive within {DEADLINE_S:.0f} s") from None
        return got

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> None:
        """t becomes op over the group's tensors (rank order), in place."""
        vals = self._exchange(t.detach().clone())
        acc = vals[0].clone()
        for v in vals[1:]:
            acc = torch.maximum(acc, v) if op == "max" else acc.add_(v)
        t.detach().copy_(acc)

    def reduce_scatter(self, out: torch.Tensor, inputs: list[torch.Tensor]) -> None:
        """out becomes the sum over the group of every rank's inputs[rank]."""
        vals = self._exchange([x.detach().clone() for x in inputs])
        acc = vals[0][self.rank].clone()
        for v in vals[1:]:
            acc.add_(v[self.rank])
        out.detach().copy_(acc)

    def all_gather(self, outs: list[torch.Tensor], t: torch.Tensor) -> None:
        """outs[i] becomes group rank i's t."""
        for o, v in zip(outs, self._exchange(t.detach().clone()), strict=True):
            o.detach().copy_(v)


class ThreadMesh:
    """dp x tp thread ranks, TP innermost; `groups(rank)` is that rank's (tp_group, dp_group)."""

    def __init__(self, dp: int, tp: int) -> None:
        self.dp, self.tp = dp, tp
        self._tp_rooms = [_Room(tp) for _ in range(dp)]
        self._dp_rooms = [_Room(dp) for _ in range(tp)]

    def groups(self, rank: int) -> tuple[ThreadGroup, ThreadGroup]:
        """`rank`'s tensor-parallel group (its dp row) and data-parallel group (its tp column)."""
        d, t = divmod(rank, self.tp)
        tp_ranks = [d * self.tp + i for i in range(self.tp)]
        dp_ranks = [i * self.tp + t for i in range(self.dp)]
        return (ThreadGroup(tp_ranks, rank, self._tp_rooms[d]),
                ThreadGroup(dp_ranks, rank, self._dp_rooms[t]))


def run(n: int, fn: Callable[[int], Any]) -> list[Any]:
    """fn(rank) on n threads; the results by rank. A rank's exception is raised here, naming it."""
    results: list[Any] = [None] * n
    errors: list[tuple[int, BaseException]] = []

    def one(r: int) -> None:
        try:
            results[r] = fn(r)
        except BaseException as e:  # reported below, with its rank
            errors.append((r, e))

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S * 2)
    if errors:
        r, e = min(errors, key=lambda x: x[0])
        raise MicroDDPError(f"thread rank {r} failed: {type(e).__name__}: {e}") from e
    if any(t.is_alive() for t in threads):
        raise MicroDDPError(f"thread ranks still running after {DEADLINE_S * 2:.0f} s")
    return results
