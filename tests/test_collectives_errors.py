"""Bad input to the collectives: the same clear MicroDDPError on every rank, never a hang,
and the group still works afterwards."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import microddp
from errors_helpers import message
from microddp import MicroDDPError
from microddp import collectives as C

ALL_REDUCES = [C.ring_all_reduce, C.tree_all_reduce, C.naive_all_reduce]


def _every_call(x: torch.Tensor, p: int, rank: int, group=None) -> list:
    """All nine collectives on `x` (the roots are global rank 0)."""
    calls = [lambda f=f: f(x.clone(), group=group) for f in ALL_REDUCES]
    calls += [
        lambda: C.tree_broadcast(x.clone(), 0, group),
        lambda: C.tree_reduce(x.clone(), 0, group=group),
        lambda: C.ring_all_gather([torch.empty_like(x) for _ in range(p)], x, group),
        lambda: C.ring_reduce_scatter(torch.empty_like(x), [x] * p, group=group),
        lambda: C.scatter(x.clone(), [x] * p if rank == 0 else None, 0, group),
        lambda: C.gather(x, [torch.empty_like(x) for _ in range(p)] if rank == 0 else None,
                         group=group),
    ]
    return calls


def _mismatch(world, what: str) -> list[str]:
    if what == "shape":
        x = torch.zeros(3 + world.rank)  # every rank a different length
    else:
        x = torch.zeros(3, dtype=(torch.float32, torch.float64, torch.bfloat16)[world.rank])
    out = [message(c) for c in _every_call(x, world.world_size, world.rank)]
    y = torch.ones(5)
    C.ring_all_reduce(y)  # the group is still usable
    out.append(f"ok {y.tolist()}")
    return out


@pytest.mark.parametrize("what", ["shape", "dtype"])
def test_different_shapes_or_dtypes_raise_on_every_rank(what):
    out = microddp.launch.spawn(_mismatch, 3, (what,), timeout=90)
    mine = {"shape": lambda r: f"shape=({3 + r},)",
            "dtype": lambda r: f"dtype={(torch.float32, torch.float64, torch.bfloat16)[r]}"}
    for rank, messages in enumerate(out):
        *errors, last = messages
        assert len(errors) == 9
        for m in errors:
            assert f"ranks disagree on {what}" in m and mine[what](rank) in m, m
            assert "MICRODDP_DUPLEX" not in m, m  # a setting all ranks agree on: not shown
        assert last == "ok [3.0, 3.0, 3.0, 3.0, 3.0]"


def _on_a_sub_group(world) -> list[str]:
    """A mismatch inside the sub-group {0, 2}: both members raise, rank 1 is not involved."""
    group = dist.new_group([0, 2])
    if world.rank == 1:
        return []
    x = torch.zeros(3 + world.rank)
    return [message(c) for c in _every_call(x, 2, world.rank, group)]


def test_a_mismatch_in_a_sub_group_raises_on_its_members():
    out = microddp.launch.spawn(_on_a_sub_group, 3, timeout=90)
    assert out[1] == []
    for rank in (0, 2):
        assert len(out[rank]) == 9
        for m in out[rank]:
            assert "ranks disagree on shape" in m and f"group rank {rank // 2}" in m, m


def _dtype_and_op(world) -> list[str]:
    f64 = torch.zeros(4, dtype=torch.float64 if world.rank == 1 else torch.float32)
    out = [message(lambda: C.ring_all_reduce(f64))]
    op = "max" if world.rank == 0 else "sum"
    out.append(message(lambda: C.tree_all_reduce(torch.zeros(4), op)))
    # avg is invalid for integers on rank 1 only: rank 1 says why, the others must not hang
    t = torch.zeros(4, dtype=torch.int64) if world.rank == 1 else torch.zeros(4)
    out.append(message(lambda: C.naive_all_reduce(t, "avg", check=True)))
    out.append(message(lambda: C.ring_all_reduce(torch.zeros(2, dtype=torch.int64), "avg")))
    out.append(message(lambda: C.tree_all_reduce(torch.zeros(2), "median")))
    out.append(message(lambda: C.tree_broadcast(torch.zeros(2), src=world.world_size)))
    out.append(message(lambda: C.scatter(torch.zeros(2), [torch.zeros(2)] if world.rank == 0
                                          else None)))
    return out


def test_dtype_op_and_argument_errors_are_shared():
    out = microddp.launch.spawn(_dtype_and_op, 3, timeout=90)
    for rank, m in enumerate(out):
        assert "ranks disagree on dtype" in m[0] and "float" in m[0]
        assert "ranks disagree on op" in m[1]
        if rank == 1:
            assert "op 'avg' needs a floating-point tensor" in m[2]
        else:
            assert "another rank of the group rejected its arguments" in m[2]
        assert "op 'avg' needs a floating-point tensor, got torch.int64" in m[3]
        assert "unknown reduce op 'median'" in m[4]
        assert "src=3 is not a member of the group" in m[5]
        if rank == 0:
            assert "scatter_list must hold one tensor per rank of the group (3), got 1" in m[6]
        else:
            assert "another rank of the group rejected its arguments" in m[6]


@pytest.mark.parametrize("bad", [[1, 2, 3], "tensor"])
def test_non_tensor_input_is_rejected(bad):
    with pytest.raises(MicroDDPError, match="must be a torch.Tensor"):
        C.ring_all_reduce(bad)


def test_list_entries_must_match_the_tensor():
    with pytest.raises(MicroDDPError, match=r"input_list\[0\] is \(3,\) torch.float32"):
        C.ring_reduce_scatter(torch.zeros(2), [torch.zeros(3)])


def _reducing_calls(x: torch.Tensor, p: int, op: str) -> list:
    """The five collectives that take an op."""
    return [lambda f=f: f(x.clone(), op) for f in ALL_REDUCES] + [
        lambda: C.tree_reduce(x.clone(), 0, op),
        lambda: C.ring_reduce_scatter(torch.empty_like(x), [x] * p, op)]


def _ops_and_roots(world) -> dict[str, list[str]]:
    p, r = world.world_size, world.rank
    return {
        "differ": [message(c) for c in _reducing_calls(torch.zeros(4), p,
                                                       "max" if r == 0 else "sum")],
        "avg on int64": [message(c) for c in _reducing_calls(
            torch.zeros(4, dtype=torch.int64), p, "avg")],
        "band on float": [message(c) for c in _reducing_calls(torch.zeros(4), p, "band")],
        # rank 1 names another root than ranks 0 and 2
        "roots": [message(lambda: C.tree_broadcast(torch.zeros(2), src=r % 2)),
                  message(lambda: C.tree_reduce(torch.zeros(2), dst=r % 2)),
                  message(lambda: C.scatter(torch.zeros(2), [torch.zeros(2)] * p
                                             if r == r % 2 else None, src=r % 2)),
                  message(lambda: C.gather(torch.zeros(2), [torch.zeros(2) for _ in range(p)]
                                            if r == r % 2 else None, dst=r % 2))],
    }


def test_op_and_root_errors_name_the_problem_on_every_rank():
    out = microddp.launch.spawn(_ops_and_roots, 3, timeout=90)
    for rank, m in enumerate(out):
        assert len(m["differ"]) == 5 and all("ranks disagree on op" in e for e in m["differ"])
        assert len(m["avg on int64"]) == 5 and all(
            "op 'avg' needs a floating-point tensor, got torch.int64" in e
            for e in m["avg on int64"]), m
        assert len(m["band on float"]) == 5 and all(
            "op 'band' needs an integer or bool tensor, got torch.float32" in e
            for e in m["band on float"]), m
        for e, name in zip(m["roots"], ("src", "dst", "src", "dst"), strict=True):
            assert f"ranks disagree on {name}" in e and f"{name}={rank % 2}" in e, (rank, e)


def _expanded(world) -> dict:
    """Rank 1 passes an expand()ed tensor (one memory location for all its elements) where a
    result must be written: it says why, the others are told a rank gave up. Where such a
    tensor is only read, the collective works and gives torch's answer."""
    p, r = world.world_size, world.rank
    x = torch.full((4,), float(r + 1))
    e = torch.full((1,), float(r + 1)).expand(4) if r == 1 else x.clone()

    def outs() -> list[torch.Tensor]:
        return [e if i == 2 else torch.empty(4) for i in range(p)]
    written = [lambda f=f: f(e) for f in ALL_REDUCES] + [
        lambda: C.tree_broadcast(e, 0), lambda: C.tree_reduce(e, dst=1),
        lambda: C.scatter(e, [x] * p if r == 0 else None, 0),
        lambda: C.ring_reduce_scatter(e, [x] * p),
        lambda: C.ring_all_gather(outs() if r == 1 else [torch.empty(4) for _ in range(p)], x),
        lambda: C.gather(x, outs() if r == 1 else None, dst=1)]
    errors = [message(c) for c in written]
    # Only read: all-gather's and gather's input, scatter's and reduce-scatter's lists, and
    # reduce's tensor on a rank that is not the destination.
    ex = [torch.full((1,), float(10 * r + i)).expand(4) for i in range(p)]
    read = {"all_gather": C.ring_all_gather([torch.empty(4) for _ in range(p)], e),
            "reduce_scatter": [C.ring_reduce_scatter(torch.empty(4), ex)],
            "reduce": [C.tree_reduce(e.clone() if r == 0 else e, dst=0)]}
    sc = torch.empty(4)
    C.scatter(sc, ex if r == 0 else None, 0)
    g = [torch.empty(4) for _ in range(p)] if r == 0 else None
    C.gather(e, g, dst=0)
    read.update(scatter=[sc], gather=g or [])
    return {"errors": errors, "read": {k: [t.tolist() for t in v] for k, v in read.items()}}


def test_expanded_tensors_are_refused_where_a_result_is_written():
    out = microddp.launch.spawn(_expanded, 3, timeout=90)
    for rank, m in enumerate(out):
        assert len(m["errors"]) == 9
        for e in m["errors"]:
            if rank == 1:
                assert "share memory (an expand()ed or as_strided view" in e and ".clone()" in e, e
            else:
                assert "another rank of the group rejected its arguments" in e, e
        read = m["read"]
        assert read["all_gather"] == [[1.0] * 4, [2.0] * 4, [3.0] * 4]
        assert read["reduce_scatter"] == [[float(30 + 3 * rank)] * 4]  # sum over r of 10r + rank
        assert read["scatter"] == [[float(rank)] * 4]  # rank 0's list: 0, 1, 2
        assert read["reduce"] == [[6.0] * 4] if rank == 0 else read["reduce"] == [
            [float(rank + 1)] * 4]
    assert out[0]["read"]["gather"] == [[1.0] * 4, [2.0] * 4, [3.0] * 4]


def test_sparse_tensors_are_refused_and_empty_expanded_ones_accepted():
    """In a world of one process: the check runs before any exchange, as it would on p ranks."""
    with pytest.raises(MicroDDPError, match=r"torch.sparse_coo tensor; .*\.to_dense\(\)"):
        C.ring_all_reduce(torch.eye(3).to_sparse())
    with pytest.raises(MicroDDPError, match=r"output is a torch.sparse_coo tensor"):
        C.ring_reduce_scatter(torch.zeros(3).to_sparse(), [torch.zeros(3).to_sparse()])
    empty = torch.empty(0).expand(3, 0)  # stride 0, but no element to share memory with
    assert C.tree_all_reduce(empty) is empty
