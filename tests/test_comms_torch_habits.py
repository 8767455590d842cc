"""Calls written with torch.distributed's habits: dist.ReduceOp objects, handles waited on with
a timeout, roots and lists that are wrong. Each gives torch's result or a MicroDDPError, never
a backend's abort or an error of another type."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import microddp as mdp
from errors_helpers import message
from microddp import collectives, comms


@pytest.mark.parametrize("op", [dist.ReduceOp(dist.ReduceOp.MAX), dist.ReduceOp.MAX, "MAX"])
def test_every_spelling_of_an_op_is_accepted(op):
    t = torch.tensor([1.0, 2.0])
    comms.all_reduce(t, op)
    assert torch.equal(collectives.tree_all_reduce(t, op), torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize(
    "call, says",
    [
        (lambda: comms.all_reduce(torch.ones(2, dtype=torch.complex64), "max"), "complex"),
        (lambda: comms.reduce(torch.ones(2, dtype=torch.complex64), 0, "product"), "complex"),
        (lambda: comms.all_reduce(torch.ones(2), dist.ReduceOp.PREMUL_SUM), "unknown reduce op"),
        (lambda: comms.broadcast(torch.ones(2), src=1), r"src=1 is not a rank"),
        (lambda: comms.gather(torch.ones(2), [torch.ones(2)], dst=-1), r"dst=-1 is not a rank"),
        # torch.Tensor.copy_ would broadcast (3,) into (2, 3) without a word
        (lambda: comms.all_gather([torch.zeros(2, 3)], torch.ones(3)), r"tensor_list\[0\] is"),
        (lambda: comms.scatter(torch.ones(2), [torch.ones(2)] * 2), "one tensor per rank"),
        (lambda: comms.gather(torch.ones(2), torch.ones(1, 2)), "a tensor, not a list"),
        (lambda: comms.new_group([0], "gloo"), "second argument is the timeout, as in torch"),
    ],
)
def test_torch_habits_that_are_mistakes_get_a_clear_error(call, says):
    with pytest.raises(mdp.MicroDDPError, match=says):
        call()


def _habits(world):
    out = {}
    t = torch.tensor([float(world.rank), 5.0 - world.rank])
    u = t.clone()
    comms.all_reduce(t, dist.ReduceOp(dist.ReduceOp.MAX))
    dist.all_reduce(u, dist.ReduceOp(dist.ReduceOp.MAX))
    out["reduce_op_object"] = (t.tolist(), u.tolist())
    t = torch.full((3,), float(world.rank + 1))
    handle = comms.all_reduce(t, "avg", async_op=True)
    out["handle"] = (handle.wait(timeout=timedelta(seconds=30)),
                     [x.tolist() for x in handle.result()], handle.exception())
    only_me = [comms.new_group([0]), comms.new_group([1])][world.rank]
    both = comms.new_group([0, 1], timedelta(seconds=30))  # torch's order: ranks, timeout
    t = torch.tensor([world.rank + 1.0])
    comms.all_reduce(t, group=both)
    out["positional_timeout"] = t.item()
    # Every rank makes the same mistake, so none waits for another (gloo would abort the
    # process on the first; torch's error for the others is the backend's or a ValueError).
    out["errors"] = [
        message(lambda: comms.reduce_scatter(torch.ones(3), [torch.ones(3), torch.ones(4)])),
        message(lambda: comms.broadcast(torch.ones(2), src=2)),
        message(lambda: comms.broadcast(torch.ones(2), src=1 - world.rank, group=only_me)),
        message(lambda: comms.all_gather([torch.zeros(2), torch.zeros(2, dtype=torch.int64)],
                                          torch.ones(2))),
    ]
    return out


def test_torch_habits_on_two_ranks():
    for rank, out in enumerate(mdp.spawn(_habits, 2, timeout=90)):
        mine, torchs = out["reduce_op_object"]
        assert mine == torchs == [1.0, 5.0]
        assert out["handle"] == (True, [[1.5] * 3], None)
        assert out["positional_timeout"] == 3.0
        shape, root, member, dtype = out["errors"]
        assert "input_list[1] is (4,)" in shape, shape
        assert "src=2 is not a rank of the group (global ranks [0, 1])" in root, root
        assert f"src={1 - rank} is not a rank of the group (global ranks [{rank}])" in member
        assert "tensor_list[1] is (2,) torch.int64" in dtype, dtype


def _group_ranks(world):
    """Sub-group {1, 2} (group ranks 0, 1); rank 0 is outside it. Roots given as torch 2.13
    allows, by rank inside the group, through comms, collectives and torch itself."""
    g = comms.new_group([2, 1])
    me = float(world.rank + 1)
    if world.rank == 0:
        t = torch.full((2,), me)
        skipped = (comms.broadcast(t, group=g, group_src=1),
                   collectives.tree_broadcast(t, group=g, group_src=1).tolist())
        # no root at all: skipped too (torch would raise a ValueError for global rank 0)
        rootless = (comms.broadcast(t, group=g), comms.reduce(t, group=g))
        return skipped, comms.recv(t, group=g, group_src=1), t.tolist(), rootless
    out = {}
    rooted = {  # the same call three ways; reduce's result is defined on its root only
        "broadcast": ([dist.broadcast, comms.broadcast, collectives.tree_broadcast],
                      {"group_src": 1}, True),
        "reduce": ([dist.reduce, comms.reduce, collectives.tree_reduce], {"group_dst": 0},
                   world.rank == 1),
    }
    for kind, (fns, root, defined) in rooted.items():
        for name, fn in zip(("torch", "comms", "tree"), fns, strict=True):
            t = torch.full((2,), me)
            fn(t, group=g, **root)
            out[f"{kind}_{name}"] = t.tolist() if defined else None
    parts = [torch.full((2,), 10.0), torch.full((2,), 20.0)] if world.rank == 2 else None
    for name, fn in [("comms", comms.scatter), ("collectives", collectives.scatter)]:
        t = torch.zeros(2)
        fn(t, parts, group=g, group_src=1)
        out[f"scatter_{name}"] = t.tolist()
    for name, fn in [("comms", comms.gather), ("collectives", collectives.gather)]:
        got = [torch.zeros(2), torch.zeros(2)] if world.rank == 1 else None
        fn(torch.full((2,), me), got, group=g, group_dst=0)
        out[f"gather_{name}"] = [x.tolist() for x in got] if got else None
    if world.rank == 2:
        comms.send(torch.full((2,), 7.0), group=g, group_dst=0)
    else:
        t = torch.zeros(2)
        out["recv"] = (comms.recv(t, group=g, group_src=1), t.tolist())
    out["errors"] = [message(lambda: comms.broadcast(torch.ones(2), 2, g, group_src=1)),
                     message(lambda: collectives.tree_broadcast(torch.ones(2), group=g,
                                                                 group_src=2)),
                     message(lambda: comms.broadcast(torch.ones(2), group=g)),
                     message(lambda: comms.send(torch.ones(2), dst=0, group=g))]
    return out


def test_roots_given_as_group_ranks_as_torch_allows():
    outsider, one, two = mdp.spawn(_group_ranks, 3, timeout=90)
    assert outsider == ((None, [1.0, 1.0]), -1, [1.0, 1.0], (None, None))  # skipped, as torch
    for out in (one, two):
        assert out["broadcast_torch"] == [3.0] * 2
        assert out["broadcast_comms"] == out["broadcast_tree"] == out["broadcast_torch"]
        assert out["scatter_comms"] == out["scatter_collectives"]
        assert "pass src (a global rank) or group_src" in out["errors"][0]
        assert "group_src=2 is not a rank of the group (0 to 1)" in out["errors"][1]
        assert "no src given, so the root is global rank 0, which is not in the group (global " \
               "ranks [1, 2])" in out["errors"][2], out["errors"][2]
        assert "send: rank 0 is not in the group (global ranks [1, 2])" in out["errors"][3]
    assert one["reduce_comms"] == one["reduce_tree"] == one["reduce_torch"] == [5.0] * 2
    assert (one["scatter_comms"], two["scatter_comms"]) == ([10.0] * 2, [20.0] * 2)
    assert one["gather_comms"] == one["gather_collectives"] == [[2.0] * 2, [3.0] * 2]
    assert one["recv"] == (2, [7.0] * 2)  # the sender's global rank, as torch returns
