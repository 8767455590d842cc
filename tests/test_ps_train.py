"""A real server and two workers (3 ranks, gloo): staleness 0 trains to the parameters of one
process with the same global batch; SSP never applies a gradient staler than S, even with a
straggler; backup workers make every update use exactly N-b gradients."""

import math

import pytest
import torch

import microddp as mdp
from microddp import ps
from microddp.data import load_dataset

STEPS, BATCH, LR = 6, 48, 0.2


def make_model():
    torch.manual_seed(0)
    return mdp.FullMLP(16, 2, n_classes=10, in_features=64)


def task():
    data = load_dataset("digits")
    return ps.Task(make_model, data.train, BATCH, data.test, seed=3)


def job(world, config):
    report = ps.run(world, task(), config)
    if world.rank != ps.SERVER:
        return report.gradients
    return {"state": report.state, "staleness": report.staleness,
            "per_update": report.per_update, "updates": report.updates,
            "applied": report.applied, "discarded": report.discarded, "lost": report.lost}


def run(**kw):
    return mdp.spawn(job, 3, (ps.PSConfig(steps=STEPS, lr=LR, **kw),), backend="gloo",
                     timeout=120)


def single_process(momentum=0.0):
    t = task()
    model = t.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)
    for step in range(STEPS):
        opt.zero_grad()
        t.loss(model, step).backward()
        opt.step()
    return model.state_dict()


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_staleness_0_equals_one_process_with_the_global_batch(momentum):
    server, *workers = run(staleness=0, momentum=momentum)
    assert server["updates"] == STEPS and server["per_update"] == [2] * STEPS
    assert set(server["staleness"]) == {0} and workers == [STEPS, STEPS]
    reference = single_process(momentum)
    for name, value in reference.items():
        torch.testing.assert_close(server["state"][name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bound", [1, 2])
def test_ssp_never_applies_a_gradient_staler_than_the_bound(bound):
    server, *_ = run(staleness=bound, stragglers={2: 3.0})
    # The run stops at the update that reaches 2 x STEPS gradients; an update applies all it
    # holds, so with 2 workers the last may take one more.
    assert len(server["staleness"]) == server["applied"] in (2 * STEPS, 2 * STEPS + 1)
    assert max(server["staleness"]) <= bound
    assert server["discarded"] == 0


def test_fully_async_applies_each_gradient_alone():
    server, *_ = run(staleness=math.inf, stragglers={2: 3.0})
    assert server["per_update"] == [1] * (2 * STEPS)
    assert server["updates"] == server["applied"] == 2 * STEPS


def test_backup_worker_updates_use_exactly_n_minus_b_gradients():
    server, *_ = run(staleness=0, backup_workers=1, stragglers={2: 3.0})
    assert server["per_update"] == [1] * (2 * STEPS)
    assert set(server["staleness"]) == {0}
