"""Gradients cleared the usual ways are cleared, or the step refuses: under ZeRO-2 and ZeRO-3
the averaged gradients live in the rank's shards, which the inner module's zero_grad() or the
loop's own optimizer's zero_grad() cannot reach. Before, each step then applied the sum of
every gradient so far, with no error (issue 47); now step() refuses in one line, and ZeRO-1
(whose gradients stay in .grad) trains to one process's parameters whichever way is used."""

import torch

import microddp as mdp
from microddp import zero
from microddp.errors import MicroDDPError
from zero_helpers import OPTIMIZERS, STEPS, fresh, groups, local, loss_fn, max_diff, single


def train(world, stage: int, clear: str):
    model = fresh()
    cls, kw = OPTIMIZERS["sgd"]
    z = zero.Zero(model, cls, stage=stage, param_groups=groups(model), **kw)
    own = torch.optim.SGD(model.parameters(), lr=0.1)  # a loop's own optimizer, for zero_grad
    clears = {"wrapper": z.zero_grad, "inner module": model.zero_grad, "own optimizer": own.zero_grad}
    for step in range(STEPS):
        x, y = local(world, step)
        loss_fn(z(x), y).backward()
        try:
            z.step()
        except MicroDDPError as e:
            return step, str(e)
        clears[clear]()
    with z.gathered() as m:
        return max_diff([p.detach().clone() for p in m.parameters()], single("sgd")), None


def every_way(world):
    return {(stage, clear): train(world, stage, clear) for stage in zero.STAGES
            for clear in ("wrapper", "inner module", "own optimizer")}


def test_uncleared_shard_gradients_refuse_the_step_never_sum():
    for out in mdp.spawn(every_way, 2, backend="gloo", timeout=180):
        for (stage, clear), (result, error) in out.items():
            if clear == "wrapper" or stage == 1:
                assert error is None and result <= 1e-6, (stage, clear, result, error)
            else:
                # refused at the second step, before applying anything wrong
                assert result == 1 and "zero_grad() on the Zero wrapper" in error, (stage, clear)
                assert "\n" not in error
