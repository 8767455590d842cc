"""Bad input to the collectives: the same clear MicroDDPError on every rank, never a hang,
and the group still works afterwards."""

from __future__ import annotations

import pytest
import torch

import microddp
from microddp import MicroDDPError
from microddp import collectives as C

ALL_REDUCES = [C.ring_all_reduce, C.tree_all_reduce, C.naive_all_reduce]


def _message(fn) -> str:
    try:
        fn()
    except MicroDDPError as e:
        return str(e)
    return "no error"


def _shape_mismatch(world) -> list[str]:
    x = torch.zeros(3 + world.rank)  # every rank a different length
    p = world.world_size
    calls = [lambda f=f: f(x.clone()) for f in ALL_REDUCES]
    calls += [
        lambda: C.tree_broadcast(x.clone(), 0),
        lambda: C.tree_reduce(x.clone(), 0),
        lambda: C.ring_all_gather([torch.empty_like(x) for _ in range(p)], x),
        lambda: C.ring_reduce_scatter(torch.empty_like(x), [x] * p),
        lambda: C.scatter(x, [x] * p if world.rank == 0 else None, 0),
        lambda: C.gather(x, [torch.empty_like(x) for _ in range(p)] if world.rank == 0 else None),
    ]
    out = [_message(c) for c in calls]
    y = torch.ones(5)
    C.ring_all_reduce(y)  # the group is still usable
    out.append(f"ok {y.tolist()}")
    return out


def test_different_shapes_raise_on_every_rank():
    out = microddp.spawn(_shape_mismatch, 3, timeout=90)
    for rank, messages in enumerate(out):
        *errors, last = messages
        assert len(errors) == 9
        for m in errors:
            assert "ranks disagree on shape" in m and f"shape=({3 + rank},)" in m, m
        assert last == "ok [3.0, 3.0, 3.0, 3.0, 3.0]"


def _dtype_and_op(world) -> list[str]:
    f64 = torch.zeros(4, dtype=torch.float64 if world.rank == 1 else torch.float32)
    out = [_message(lambda: C.ring_all_reduce(f64))]
    op = "max" if world.rank == 0 else "sum"
    out.append(_message(lambda: C.tree_all_reduce(torch.zeros(4), op)))
    # avg is invalid for integers on rank 1 only: rank 1 says why, the others must not hang
    t = torch.zeros(4, dtype=torch.int64) if world.rank == 1 else torch.zeros(4)
    out.append(_message(lambda: C.naive_all_reduce(t, "avg", check=True)))
    out.append(_message(lambda: C.ring_all_reduce(torch.zeros(2, dtype=torch.int64), "avg")))
    out.append(_message(lambda: C.tree_all_reduce(torch.zeros(2), "median")))
    out.append(_message(lambda: C.tree_broadcast(torch.zeros(2), src=world.world_size)))
    out.append(_message(lambda: C.scatter(torch.zeros(2), [torch.zeros(2)] if world.rank == 0
                                          else None)))
    return out


def test_dtype_op_and_argument_errors_are_shared():
    out = microddp.spawn(_dtype_and_op, 3, timeout=90)
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
