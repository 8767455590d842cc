"""The algorithms are built on send/recv alone: with every torch.distributed collective
replaced by a trap, they still run, and still match what the real collectives computed."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import Backend

import microddp
from microddp import collectives as C
from microddp.collectives.ring import (
    PAIR_MIN_CHUNK,
    PREPOST_MAX_CHUNK,
    planned_ring_all_reduce_,
    posting,
)
from microddp.collectives.ring.loops import _batched_ring_all_reduce_, pair_all_reduce_
from microddp.collectives.ring.plan import make_plan
from microddp.transport.duplex import duplex_enabled
from microddp.transport.peers import Peers

PAIR = [0, 2]  # a sub-group
# int64 x of 7 elements, repeated: 3 chunks each a little over PREPOST_MAX_CHUNK bytes
BIG_REPEAT = 3 * PREPOST_MAX_CHUNK // (7 * 8) + 1

COLLECTIVES = [
    "all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather",
    "all_gather_into_tensor", "all_gather_object", "reduce_scatter", "reduce_scatter_tensor",
    "gather", "scatter", "barrier", "monitored_barrier", "all_to_all", "all_to_all_single",
    "broadcast_object_list", "gather_object", "scatter_object_list", "batch_isend_irecv",
]
PG_METHODS = [
    "allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather", "_allgather_base",
    "allgather_coalesced", "allgather_into_tensor_coalesced", "all_gather_single",
    "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced",
    "reduce_scatter_single", "gather", "scatter", "barrier", "monitored_barrier", "alltoall",
    "alltoall_base", "all_to_all_single",
]


def _trap(name):
    def trap(*args, **kwargs):
        raise AssertionError(f"built-in collective {name} was called")
    return trap


def _ring_paths(x: torch.Tensor, p: int, me: int) -> list[torch.Tensor]:
    """The sum of `x` over 3 ranks by the ring's loops (ring/loops.py picks one by chunk size and
    world size; the plain loop, which it never picks, and the NCCL loop are called
    directly; the pair loop runs on 2 ranks, in _everything)."""
    peers = Peers()
    out = [C.ring_all_reduce(x.clone(), segment_bytes=16),  # the pipeline
           C.ring_all_reduce(x.clone())]  # small chunks on 3 ranks: every receive posted first
    big = x.repeat(BIG_REPEAT)  # chunks above PREPOST_MAX_CHUNK: "lookahead"
    out.append(C.ring_all_reduce(big))
    y = x.clone()
    planned_ring_all_reduce_(peers, make_plan(y, p, me), "sum", "plain")
    out.append(y)
    y = x.clone()
    _batched_ring_all_reduce_(peers, make_plan(y, p, me), "sum")
    out.append(y)
    return out


def _everything(x: torch.Tensor, p: int, me: int, pair) -> list[torch.Tensor]:
    parts = [x * (i + 1) for i in range(p)]
    out = _ring_paths(x, p, me)
    out += [C.tree_all_reduce(x.clone(), "max"), C.naive_all_reduce(x.clone(), "product"),
            C.ring_all_reduce(x.double(), "avg"), C.tree_broadcast(x.clone(), src=p - 1),
            C.ring_reduce_scatter(torch.empty_like(x), parts, "min")]
    out += C.ring_all_gather([torch.empty_like(x) for _ in range(p)], x)
    red = C.tree_reduce(x.clone(), dst=1, op="sum")
    out.append(red if me == 1 else torch.zeros_like(x))
    sc = torch.empty_like(x)
    C.scatter(sc, parts if me == 0 else None, src=0)
    out.append(sc)
    g = [torch.empty_like(x) for _ in range(p)] if me == 2 else None
    C.gather(x, g, dst=2)
    out += g if me == 2 else [torch.zeros_like(x)] * p
    # a sub-group of two: the 2-rank ring (plain), the pair loop (large chunks on 2 ranks, here
    # in 3 segments), the tree and naive on group ranks
    if me in PAIR:
        y = x.clone()
        pair_all_reduce_(Peers(pair), y, "sum", 3)
        out += [C.ring_all_reduce(x.clone(), group=pair), y,
                C.tree_all_reduce(x.clone(), group=pair),
                C.naive_all_reduce(x.clone(), "max", group=pair)]
    return out


def _reference(x: torch.Tensor, p: int, me: int, pair) -> list[torch.Tensor]:
    """The same results from torch.distributed's own collectives."""
    def ar(t, op, group=None):
        t = t.clone()
        dist.all_reduce(t, op, group=group)
        return t
    parts = [x * (i + 1) for i in range(p)]
    b = x.clone()
    dist.broadcast(b, p - 1)
    rs = torch.empty_like(x)
    dist.reduce_scatter(rs, parts, dist.ReduceOp.MIN)
    out = [ar(x, dist.ReduceOp.SUM)] * 2 + [ar(x.repeat(BIG_REPEAT), dist.ReduceOp.SUM)]
    out += [ar(x, dist.ReduceOp.SUM)] * 2  # the plain and NCCL loops
    out += [ar(x, dist.ReduceOp.MAX), ar(x, dist.ReduceOp.PRODUCT),
            ar(x.double(), dist.ReduceOp.SUM) / p, b, rs]
    ag = [torch.empty_like(x) for _ in range(p)]
    dist.all_gather(ag, x)
    out += ag
    r = x.clone()
    dist.reduce(r, 1)
    out.append(r if me == 1 else torch.zeros_like(x))
    sc = torch.empty_like(x)
    dist.scatter(sc, parts if me == 0 else None, src=0)
    out.append(sc)
    g = [torch.empty_like(x) for _ in range(p)] if me == 2 else None
    dist.gather(x, g, dst=2)
    out += g if me == 2 else [torch.zeros_like(x)] * p
    if me in PAIR:
        out += [ar(x, dist.ReduceOp.SUM, pair)] * 3 + [ar(x, dist.ReduceOp.MAX, pair)]
    return out


def _run_trapped(world) -> tuple[bool, int]:
    x = torch.arange(1, 8, dtype=torch.int64) * (world.rank + 2)
    pair = dist.new_group(PAIR)  # made before the traps: new_group may synchronise the ranks
    expected = _reference(x, world.world_size, world.rank, pair)
    sends = {"group": 0, "backend": 0}
    for name in COLLECTIVES:
        for module in (dist, c10d):
            if hasattr(module, name):
                setattr(module, name, _trap(name))
    # The 2-rank ring's second connection (transport/duplex.py) is a gloo backend object, not a
    # ProcessGroup: its class (Backend) is trapped and counted too. Calls that go through a
    # ProcessGroup reach its backend inside C++, so these traps see only direct calls.
    for cls, kind in ((dist.ProcessGroup, "group"), (Backend, "backend")):
        for name in PG_METHODS:
            if hasattr(cls, name):
                setattr(cls, name, _trap(f"{cls.__name__}.{name}"))

        def counting_send(self, *args, real=cls.send, kind=kind, **kwargs):
            sends[kind] += 1
            return real(self, *args, **kwargs)
        cls.send = counting_send
    ours = _everything(x, world.world_size, world.rank, pair)
    same = len(ours) == len(expected) and all(
        torch.equal(a, b) for a, b in zip(ours, expected, strict=True))
    return same, sends


def test_no_builtin_collective_is_called():
    # the paths ring_all_reduce picks for these tensors (int64: 8 bytes an element)
    assert posting(-(-7 // 3) * 8, 3) == "prepost"
    assert posting(-(-7 * BIG_REPEAT // 3) * 8, 3) == "lookahead"
    assert posting(-(-7 // 2) * 8, 2) == "lookahead"
    assert posting(-(-7 // 3) * 8, 3, segment_bytes=16) == "pipeline"
    assert posting(PAIR_MIN_CHUNK, 2) == "pair"
    out = microddp.launch.spawn(_run_trapped, 3, timeout=90)
    assert [same for same, _ in out] == [True, True, True]
    assert all(sends["group"] > 0 for _, sends in out)  # the work went over point-to-point sends
    if duplex_enabled():  # the pair's group rank 1 (global 2) sends to 0 on its own connection
        assert out[2][1]["backend"] > 0 and out[1][1]["backend"] == 0


def _trap_is_live(world) -> str:
    """Guard against a vacuous test: the trap really fires for a built-in collective."""
    for module in (dist, c10d):
        module.all_reduce = _trap("all_reduce")
    try:
        dist.all_reduce(torch.ones(1))
    except AssertionError as e:
        return str(e)
    return "not trapped"


def test_trap_catches_a_builtin_collective():
    assert microddp.launch.spawn(_trap_is_live, 2, timeout=60) == [
        "built-in collective all_reduce was called"] * 2
