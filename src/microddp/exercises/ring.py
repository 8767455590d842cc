"""Exercise (chapter 4): the ring all-reduce from point-to-point messages alone.

The learner writes `ring_all_reduce(t)`: a reduce-scatter then an all-gather around the ring,
with `mdp.comms.isend`/`irecv` (or `send`/`recv`). It is run on 2 and 3 real ranks, on sizes
that divide by the ranks and sizes that do not (1 element among 3 ranks included), beside
`microddp.collectives.ring_all_reduce` on the same inputs. Inputs are whole numbers, so every
correct order of additions gives the same bits and the comparison can be exact.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .. import comms
from ..collectives import ring_all_reduce as reference
from .base import Exercise, Unsolved, call, guarded, load, on_ranks, run_checks

SIZES = (6, 7, 1, 1000)
STARTER = '''\
"""Chapter 4 exercise: the ring all-reduce, from send and recv alone.

Check it with:  microddp exercise check ring ring_all_reduce.py
"""

import torch

import microddp as mdp


def ring_all_reduce(t: torch.Tensor) -> None:
    """Sum `t` over every rank, in place, the way a ring does: cut `t` into world_size
    chunks; reduce-scatter (world_size - 1 steps: send one chunk to the next rank, receive one
    from the previous and add it), then all-gather (world_size - 1 steps: pass the finished
    chunks on). The chunks need not be equal: `t` may have fewer elements than ranks.

    world = mdp.init() gives world.rank and world.world_size;
    mdp.comms.isend(x, dst) and mdp.comms.irecv(x, src) start a transfer and return a handle
    whose .wait() finishes it (start both, then wait for both, so no rank blocks the ring).
    """
    raise NotImplementedError
'''


def _inputs(case: int, rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * case + rank)
    return torch.randint(-50, 50, (n,), generator=g).float()


@contextlib.contextmanager
def _no_collectives():
    """While the learner's ring runs, the ready-made collectives refuse (and come back after)."""
    names = ("all_reduce", "reduce_scatter", "all_gather", "reduce_scatter_tensor",
             "all_gather_into_tensor")
    saved = [(m, n, getattr(m, n)) for m in (comms, dist) for n in names if hasattr(m, n)]
    for m, n, _ in saved:
        setattr(m, n, _forbidden)
    try:
        yield
    finally:
        for m, n, f in saved:
            setattr(m, n, f)


def _forbidden(*_a, **_k):
    raise Unsolved("it called a collective (all_reduce, reduce_scatter or all_gather); the "
                   "point is to build one from send and recv alone")


@guarded
def _rank(world, path: str) -> list:
    fn = load(path, "ring_all_reduce")
    for case, n in enumerate(SIZES):
        mine = _inputs(case, world.rank, n)
        got = mine.clone()
        with _no_collectives():
            call(fn, path, "ring_all_reduce", got)
        want = mine.clone()
        reference(want)
        if got.shape != want.shape:
            raise Unsolved(f"a tensor of {n} elements came back with shape {tuple(got.shape)}")
        bad = (got != want).nonzero().flatten()
        if len(bad):
            i = int(bad[0])
            hint = (" (that is this rank's own value: the element was never reduced)"
                    if got[i] == mine[i] else "")
            if n % world.world_size:
                hint += (f"; {n} elements do not divide by {world.world_size} ranks: check "
                         "the last chunk's size")
            raise Unsolved(f"on a tensor of {n} elements, element {i} is {got[i].item():g}, "
                           f"the sum over the ranks is {want[i].item():g}{hint}")
    return "ok"


def check(path: str) -> list[str]:
    """What is wrong with the learner's ring in `path` (nothing: solved)."""
    load(path, "ring_all_reduce")  # a file that does not load is a one-line error first

    def cases() -> None:
        for ranks in (2, 3):
            on_ranks(_rank, ranks, (str(path),), "ring_all_reduce")
    return run_checks(cases)


EXERCISE = Exercise("ring", "4", "the ring all-reduce from send and recv", "ring_all_reduce",
                    STARTER, check)
