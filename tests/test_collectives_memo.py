"""Repeat calls of ring_all_reduce with check=False (collectives/ring/plan.py): the second call on
the same tensor runs the kept loop without checks or set-up, gives torch.distributed's result
every time, and falls back to the full path whenever something it depends on changed; with
check=True the ranks still agree first; nothing is kept past its tensor."""

import gc
import weakref

import pytest
import torch
import torch.distributed as dist

import microddp as mdp
from microddp import MicroDDPError
from microddp.collectives.ring import ring
from microddp.collectives.ring.plan import PerTensor, remembered_calls
from microddp.comms import REDUCE_OPS


def _reference(t: torch.Tensor, op: str) -> torch.Tensor:
    ref = t.clone()
    dist.all_reduce(ref, REDUCE_OPS[op])  # avg: the sum, divided below
    return ref / dist.get_world_size() if op == "avg" else ref


def repeats(world):
    p, g = world.world_size, torch.Generator().manual_seed(world.rank)
    full_path = []  # calls that went through the checks and set-up
    real_begin = ring.check_all_reduce
    ring.check_all_reduce = lambda *a, **k: (full_path.append(1), real_begin(*a, **k))[1]
    base = remembered_calls()
    out = {}

    def call(t, op="sum", **kw):
        """Contents fresh every call; did it match torch, and did it take the full path?"""
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
        ref = _reference(t, op)
        before = len(full_path)
        ring.ring_all_reduce(t, op, check=False, **kw)
        return torch.allclose(t, ref, rtol=1e-6, atol=1e-6), len(full_path) > before

    t = torch.empty(40 * p + 3)
    out["first"] = call(t)
    out["again"] = [call(t) for _ in range(3)]
    out["kept"] = remembered_calls() - base
    out["other op"] = call(t, "max")
    out["other op again"] = call(t, "max")
    out["avg"] = call(t, "avg")
    t.set_(torch.empty(40 * p + 3))  # new memory under the same tensor object
    out["new memory"] = call(t)
    out["new memory again"] = call(t)
    t.data = t.view(torch.int32)  # a new dtype at the same address, same length
    out["same memory, new dtype"] = call(t)
    out["same memory, new dtype again"] = call(t)
    t.data = torch.empty(40 * p + 3, dtype=torch.float64)  # a new dtype, same object
    out["new dtype"] = call(t)
    out["segments asked for"] = call(t, segment_bytes=64)
    strided = torch.empty(2 * (40 * p + 3))[::2]  # works on a packed copy: never kept
    out["strided"] = [call(strided) for _ in range(2)]
    out["kept before free"] = remembered_calls() - base
    # check=True on a kept tensor still agrees first: here the ranks disagree on the op
    u = torch.ones(8)
    ring.ring_all_reduce(u, check=False)
    try:
        ring.ring_all_reduce(u, "sum" if world.rank == 0 else "max")
        out["disagree"] = "no error"
    except MicroDDPError as e:
        out["disagree"] = str(e)
    # a kept call holds its group weakly: a destroyed group is freed, not kept alive
    sub = dist.new_group(list(range(p)))
    w = torch.ones(8)
    ring.ring_all_reduce(w, group=sub, check=False)
    out["sub-group"] = (w == p).all().item()
    out["sub-group again"] = call(w, group=sub)
    group_ref = weakref.ref(sub)
    dist.destroy_process_group(sub)
    del sub
    gc.collect()
    out["group freed"] = group_ref() is None
    ring.check_all_reduce = real_begin
    del t, u, w, strided
    gc.collect()
    out["after free"] = remembered_calls() - base
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_repeat_calls_skip_the_checks_and_stay_equal_to_torch(world_size):
    for r in mdp.spawn(repeats, world_size, timeout=90):
        assert r["first"] == (True, True)
        assert r["again"] == [(True, False)] * 3  # the kept loop, nothing checked again
        assert r["kept"] == 1
        assert r["other op"] == (True, True) and r["other op again"] == (True, False)
        assert r["avg"] == (True, True)
        assert r["new memory"] == (True, True) and r["new memory again"] == (True, False)
        assert r["same memory, new dtype"] == (True, True)  # only the dtype tells them apart
        assert r["same memory, new dtype again"] == (True, False)
        assert r["new dtype"] == (True, True)
        assert r["segments asked for"] == (True, True)  # the pipeline, never kept
        assert r["strided"] == [(True, True)] * 2
        assert r["kept before free"] == 1  # the strided tensor's copies are never kept
        assert "ranks disagree on op" in r["disagree"], r["disagree"]
        assert r["sub-group"] and r["sub-group again"] == (True, False)
        assert r["group freed"]
        assert r["after free"] == 0


def test_per_tensor_entries_match_their_key_and_go_with_their_tensor():
    memo = PerTensor(limit=2)
    a, b, c = torch.zeros(1), torch.zeros(1), torch.zeros(1)
    memo.put(a, ("k",), "A")
    assert memo.get(a, ("k",)) == "A" and memo.get(a, ("other",)) is None
    assert memo.get(b, ("k",)) is None  # another tensor, even with the same key
    memo.put(a, ("k2",), "A2")  # replaced in place, not added
    assert len(memo) == 1 and memo.get(a, ("k",)) is None and memo.get(a, ("k2",)) == "A2"
    memo.put(b, ("k",), "B")
    memo.put(c, ("k",), "C")  # over the limit: the oldest (a) goes
    assert len(memo) == 2 and not memo.holds(a) and memo.get(c, ("k",)) == "C"
    del b
    gc.collect()
    assert len(memo) == 1  # freed with its tensor
    # a dead tensor's callback must not drop the entry of a new tensor under the same id
    d = torch.zeros(1)
    memo.put(d, ("k",), "D")
    stale = memo._entries[id(d)][0]
    memo._entries[id(d)] = (weakref.ref(d), ("k",), "D2")  # as if d's id had been reused
    stale.__callback__(stale)
    assert memo.get(d, ("k",)) == "D2"
