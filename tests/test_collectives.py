"""microddp.collectives against torch.distributed: every algorithm, world sizes 1 to 8,
shapes, dtypes and ops drawn by hypothesis, the default group and sub-groups."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import microddp
from microddp import collectives as C
from test_collectives_cases import DTYPES, TORCH_OPS, run_cases

# What hypothesis draws for each case; the dtype and op come from the grid below, so that every
# world size sees every one of the 20 (dtype, op) pairs in every run.
DRAW = st.fixed_dictionaries({
    "seed": st.integers(0, 2**20),
    # small shapes of up to 3 dimensions or, in about half the draws, a vector of up to 4000
    "shape": st.one_of(st.lists(st.integers(0, 9), max_size=3).map(tuple),
                       st.integers(0, 4000).map(lambda n: (n,))),
    "root": st.integers(0, 7),
    "segment": st.sampled_from([8, 64, 1 << 20]),  # tiny segments: many pipelined messages
})
GRID = [(dtype, op) for dtype in sorted(DTYPES) for op in sorted(TORCH_OPS)]


def _failures(world_size: int, cases: list[dict], group_ranks=None) -> list[str]:
    out = microddp.launch.spawn(run_cases, world_size, (cases, group_ranks), timeout=120)
    return [f"[rank {r}] {f}" for r, fails in enumerate(out) for f in fails]


# One spawn runs the whole grid: starting ranks costs far more than a case. 1-6 ranks already
# hold powers of two and not, odd and even; 7 and 8 (over 2 cores) are for CI's slow run.
@pytest.mark.parametrize("world_size", [*range(1, 7), *(pytest.param(n, marks=pytest.mark.slow)
                                                      for n in (7, 8))])
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(draws=st.lists(DRAW, min_size=len(GRID), max_size=len(GRID)))
def test_every_algorithm_matches_torch(world_size, draws):
    cases = [{**d, "dtype": dtype, "op": op} for d, (dtype, op) in zip(draws, GRID, strict=True)]
    assert _failures(world_size, cases) == []


def test_edge_sizes_match_torch():
    """numel below the world size, zero, one, 0-d, odd sizes across several segments, and the
    default policy on a tensor whose chunks are too large to post every receive first."""
    cases = [
        {"seed": 1, "shape": (2,), "dtype": "float32", "op": "sum", "root": 0, "segment": 8},
        {"seed": 2, "shape": (0,), "dtype": "int64", "op": "max", "root": 1, "segment": 8},
        {"seed": 3, "shape": (), "dtype": "float64", "op": "product", "root": 4, "segment": 8},
        {"seed": 4, "shape": (1,), "dtype": "bfloat16", "op": "min", "root": 2, "segment": 8},
        {"seed": 5, "shape": (1001, 7), "dtype": "float32", "op": "avg", "root": 3,
         "segment": 4096},
        {"seed": 6, "shape": (10007,), "dtype": "int64", "op": "sum", "root": 0,
         "segment": 8192},
        # the default policy: chunks of 320 KB go whole, one message per step
        {"seed": 7, "shape": (400_003,), "dtype": "float32", "op": "sum", "root": 1,
         "segment": None},
        {"seed": 10, "shape": (300_001,), "dtype": "float64", "op": "avg", "root": 2,
         "segment": None},
    ]
    assert _failures(5, cases) == []


@pytest.mark.parametrize("group_ranks", [[1, 2, 3], [0, 3], [2]])
def test_sub_groups_match_torch(group_ranks):
    cases = [
        {"seed": 7, "shape": (5, 3), "dtype": "float32", "op": "sum", "root": 1, "segment": 16},
        {"seed": 8, "shape": (2,), "dtype": "int64", "op": "product", "root": 2, "segment": 8},
        {"seed": 9, "shape": (17,), "dtype": "bfloat16", "op": "max", "root": 0, "segment": 8},
    ]
    assert _failures(4, cases, group_ranks) == []


def _non_member(world) -> dict[str, list]:
    """Ranks outside a group leave their tensors alone, as torch does."""
    group = dist.new_group([0, 1])
    r = world.rank
    x = torch.full((4,), float(r))
    C.ring_all_reduce(x, group=group)
    C.tree_all_reduce(x, group=group)
    C.naive_all_reduce(x, group=group)
    C.tree_broadcast(x, 1, group)
    red = C.tree_reduce(torch.full((2,), float(10 * r + 1)), 0, "sum", group)
    rs = C.ring_reduce_scatter(torch.full((2,), -1.0),
                               [torch.full((2,), float(10 * r + i)) for i in range(2)],
                               "sum", group)
    ag = C.ring_all_gather([torch.full((2,), -1.0) for _ in range(2)],
                           torch.full((2,), float(r)), group)
    sc = torch.full((2,), -1.0)
    C.scatter(sc, [torch.full((2,), float(i + 5)) for i in range(2)] if r == 0 else None, 0,
              group)
    g = [torch.full((2,), -1.0) for _ in range(2)]
    C.gather(torch.full((2,), float(r)), g if r == 1 else None, 1, group)
    return {"all-reduce": x.tolist(), "reduce": red.tolist(), "reduce_scatter": rs.tolist(),
            "all_gather": [t.tolist() for t in ag], "scatter": sc.tolist(),
            "gather": [t.tolist() for t in g]}


def test_non_members_are_untouched():
    out = microddp.launch.spawn(_non_member, 3, timeout=60)
    # members: 0+1 = 1, doubled by the tree and by naive, then broadcast; rank 2 keeps its 2
    assert [o["all-reduce"] for o in out] == [[4.0] * 4, [4.0] * 4, [2.0] * 4]
    assert [o["reduce"] for o in out] == [[12.0] * 2, [11.0] * 2, [21.0] * 2]
    assert [o["reduce_scatter"] for o in out] == [[10.0] * 2, [12.0] * 2, [-1.0] * 2]
    assert [o["all_gather"] for o in out] == [[[0.0] * 2, [1.0] * 2]] * 2 + [[[-1.0] * 2] * 2]
    assert [o["scatter"] for o in out] == [[5.0] * 2, [6.0] * 2, [-1.0] * 2]
    assert out[1]["gather"] == [[0.0] * 2, [1.0] * 2]  # the dst
    assert out[2]["gather"] == [[-1.0] * 2] * 2


def _strided(world) -> list[list[float]]:
    """A transposed matrix (not contiguous) is reduced in place like a contiguous one."""
    base = torch.arange(12, dtype=torch.float64).reshape(3, 4) * (world.rank + 1)
    results = []
    for fn in (C.ring_all_reduce, C.tree_all_reduce, C.naive_all_reduce):
        x = base.clone().t()
        assert not x.is_contiguous()
        out = fn(x, "sum", segment_bytes=16) if fn is C.ring_all_reduce else fn(x, "sum")
        assert out is x
        ref = base.clone().t().contiguous()
        dist.all_reduce(ref)
        results.append(torch.equal(x, ref))
    y = (torch.arange(12.0).reshape(3, 4) + world.rank).t()
    C.tree_broadcast(y, src=1)
    results.append(torch.equal(y, (torch.arange(12.0).reshape(3, 4) + 1).t()))
    return results


def test_non_contiguous_tensors_are_handled():
    assert microddp.launch.spawn(_strided, 3, timeout=60) == [[True] * 4] * 3


def test_single_process_world_is_identity():
    """No process group at all: every algorithm returns the rank's own data."""
    x = torch.arange(6.0)
    assert torch.equal(C.ring_all_reduce(x.clone(), "avg"), x)
    assert torch.equal(C.tree_reduce(x.clone(), 0, "max"), x)
    out = [torch.empty(6)]
    C.ring_all_gather(out, x)
    assert torch.equal(out[0], x)
    rs = torch.empty(6)
    C.ring_reduce_scatter(rs, [x], "sum")
    assert torch.equal(rs, x)


BITWISE = {"band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}


def _bitwise(world) -> list[str]:
    """Every reducing collective with each bitwise op on int64, against torch's."""
    p, me = world.world_size, world.rank
    g = torch.Generator().manual_seed(me)
    x = torch.randint(-(1 << 62), 1 << 62, (5, 7), generator=g)  # negatives: all 64 bits
    parts = [torch.randint(-(1 << 62), 1 << 62, (5, 7), generator=g) for _ in range(p)]
    fails = []
    for name, op in BITWISE.items():
        ref = x.clone()
        dist.all_reduce(ref, op)
        for label, fn, kw in (("ring", C.ring_all_reduce, {}),
                              ("ring in segments", C.ring_all_reduce, {"segment_bytes": 24}),
                              ("tree", C.tree_all_reduce, {}), ("naive", C.naive_all_reduce, {})):
            if not torch.equal(fn(x.clone(), name, **kw), ref):
                fails.append(f"{label} {name}")
        red = x.clone()
        dist.reduce(red, 1, op)
        if not torch.equal(C.tree_reduce(x.clone(), 1, name), red) and me == 1:
            fails.append(f"tree_reduce {name}")
        rs, ref_rs = torch.empty_like(x), torch.empty_like(x)
        dist.reduce_scatter(ref_rs, [t.clone() for t in parts], op)
        if not torch.equal(C.ring_reduce_scatter(rs, parts, name), ref_rs):
            fails.append(f"ring_reduce_scatter {name}")
    return fails


@pytest.mark.parametrize("world_size", [3, 4])
def test_bitwise_ops_match_torch(world_size):
    assert microddp.launch.spawn(_bitwise, world_size, timeout=60) == [[]] * world_size
