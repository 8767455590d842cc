"""Calls written with torch.distributed's habits: dist.ReduceOp objects, handles waited on with
a timeout, roots and lists that are wrong. Each gives torch's result or a MicroDDPError, never
a backend's abort or an error of another type."""

import pytest
import torch
import torch.distributed as dist

import microddp as mdp
from microddp import collectives, comms


@pytest.mark.parametrize("op", [dist.ReduceOp(dist.ReduceOp.MAX), dist.ReduceOp.MAX, "MAX"])
def test_every_spelling_of_an_op_is_accepted(op):
    t = torch.tensor([1.0, 2.0])
    comms.all_reduce(t, op)
    assert torch.equal(collectives.tree_all_reduce(t, op), torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: comms.all_reduce(torch.ones(2, dtype=torch.complex64), "max"), "complex"),
        (lambda: comms.reduce(torch.ones(2, dtype=torch.complex64), 0, "product"), "complex"),
        (lambda: comms.all_reduce(torch.ones(2), dist.ReduceOp.PREMUL_SUM), "unknown reduce op"),
    ],
)
def test_torch_habits_that_are_mistakes_get_a_clear_error(call, message):
    with pytest.raises(mdp.MicroDDPError, match=message):
        call()
