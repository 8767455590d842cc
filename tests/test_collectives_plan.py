"""The ring's plans (views cut once per tensor, see collectives/ring/plan.py), for the plain ring and
the preposted one (small chunks, 3 ranks): results stay equal to
torch.distributed's when a tensor is all-reduced again, changes its contents, or has its memory
swapped; a plan lives no longer than its tensor; packed copies of strided tensors get none."""

import gc

import pytest
import torch
import torch.distributed as dist

import microddp as mdp
from microddp.collectives import ring_all_reduce
from microddp.collectives.ring import PREPOST_MAX_CHUNK, posting
from microddp.collectives.ring.plan import cached_plans


def _same_as_torch(t: torch.Tensor, op: str) -> bool:
    ref = t.clone()
    dist.all_reduce(ref, dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    if op == "avg":
        ref /= dist.get_world_size()
    ring_all_reduce(t, op)
    return torch.allclose(t, ref, rtol=1e-6, atol=1e-6)


def _numel(p: int, small: bool) -> int:
    """Small chunks: the preposted ring's plan on 3 ranks; larger ones: the plain ring's."""
    return (PREPOST_MAX_CHUNK // 4 + (-1000 if small else 1000)) * p + 3


def plans(world, small):
    p, me = world.world_size, world.rank
    n = _numel(p, small)
    g = torch.Generator().manual_seed(me)
    base = cached_plans()
    t = torch.empty(n)
    ok = []
    for op in ("sum", "avg", "max", "sum"):  # the same tensor again and again, new contents
        t.copy_(torch.randn(n, generator=g))
        ok.append(_same_as_torch(t, op))
    one_plan = cached_plans() - base
    t.set_(torch.randn(n, generator=g))  # new memory under the same tensor object
    ok.append(_same_as_torch(t, "sum"))
    still_one = cached_plans() - base
    strided = torch.randn(2 * n, generator=g)[::2]  # packed into a fresh copy on every call
    ok.append(_same_as_torch(strided, "sum"))
    ok.append(_same_as_torch(strided, "max"))
    after_strided = cached_plans() - base
    del t
    gc.collect()
    return {"ok": ok, "one_plan": one_plan, "still_one": still_one,
            "after_strided": after_strided, "after_free": cached_plans() - base}


@pytest.mark.parametrize("small", [False, True])
@pytest.mark.parametrize("world_size", [2, 3])
def test_plans_are_reused_checked_and_freed_with_their_tensor(world_size, small):
    chunk_bytes = -(-_numel(world_size, small) // world_size) * 4  # the widest chunk
    assert posting(chunk_bytes, world_size) == ("prepost" if small and world_size > 2 else
                                                 "lookahead")
    for r in mdp.spawn(plans, world_size, args=(small,), timeout=90):
        assert all(r["ok"]), r["ok"]
        assert r["one_plan"] == 1 and r["still_one"] == 1  # the swap replaced it, not added
        assert r["after_strided"] == 1  # copies are planned afresh, never kept
        assert r["after_free"] == 0
