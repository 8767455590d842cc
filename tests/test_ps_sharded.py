"""The parameters sharded over several servers (ranks 0..S-1), each worker talking to all of
them: at staleness 0 the run ends with the parameters of one server and of one process with the
same global batch; under SSP every server keeps its own bound; every exchange is one message
per server and direction (the header travels in the frame); shards cut at parameter boundaries.
"""

import math

import pytest
import torch

import microddp as mdp
from microddp import ps
from microddp.data import load_dataset
from microddp.errors import MicroDDPError
from microddp.ps import protocol
from microddp.ps.flat import FlatModel, cuts

STEPS, BATCH, LR = 6, 48, 0.2


def make_model():
    torch.manual_seed(0)
    return mdp.FullMLP(16, 2, n_classes=10, in_features=64)


def task():
    data = load_dataset("digits")
    return ps.Task(make_model, data.train, BATCH, data.test, seed=3)


def job(world, config):
    counts = {"send": 0, "irecv": 0}
    comms = protocol.comms

    class Counting:  # the protocol's view of comms, counting the messages this rank moves
        @staticmethod
        def send(*a, **k):
            counts["send"] += 1
            return comms.send(*a, **k)

        @staticmethod
        def isend(*a, **k):  # a server's send that waits at most the worker timeout
            counts["send"] += 1
            return comms.isend(*a, **k)

        @staticmethod
        def irecv(*a, **k):
            counts["irecv"] += 1
            return comms.irecv(*a, **k)

    protocol.comms = Counting
    try:
        report = ps.run(world, task(), config)
    finally:
        protocol.comms = comms
    if world.rank >= config.servers:
        return {"gradients": report.gradients, **counts}
    return {"state": report.state, "staleness": report.staleness, "updates": report.updates,
            "applied": report.applied, "per_update": report.per_update, **counts}


def run(servers, workers=2, **kw):
    config = ps.PSConfig(steps=STEPS, lr=LR, servers=servers, **kw)
    return mdp.spawn(job, servers + workers, (config,), backend="gloo", timeout=150)


def single_process(momentum):
    t = task()
    model = t.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)
    for step in range(STEPS):
        opt.zero_grad()
        t.loss(model, step).backward()
        opt.step()
    return model.state_dict()


def test_two_servers_at_staleness_0_equal_one_server_and_one_process():
    one = run(servers=1, momentum=0.9)
    two = run(servers=2, momentum=0.9)
    for r in (one[0], two[0], two[1]):
        assert r["updates"] == STEPS and r["per_update"] == [2] * STEPS
        assert set(r["staleness"]) == {0}
    reference = single_process(0.9)
    for name, value in reference.items():
        # the same sums in the same order, shard by shard: the same bits as one server
        torch.testing.assert_close(two[0]["state"][name], one[0]["state"][name], rtol=0,
                                   atol=0)
        torch.testing.assert_close(two[0]["state"][name], value, rtol=1e-5, atol=1e-6)
    # one message per exchange and direction, per server: a worker receives STEPS + 1 frames
    # (the last says stop) and sends STEPS gradients and a goodbye to each server
    for w in two[2:]:
        assert w == {"gradients": STEPS, "send": 2 * (STEPS + 1), "irecv": 2 * (STEPS + 1)}
    for w in one[1:]:
        assert w == {"gradients": STEPS, "send": STEPS + 1, "irecv": STEPS + 1}


def test_ssp_holds_its_bound_on_every_server():
    out = run(servers=2, staleness=1, stragglers={3: 3.0})
    for server in out[:2]:
        assert max(server["staleness"]) <= 1
        assert server["applied"] >= 2 * STEPS - 1  # a worker may stop on the other's word
    assert math.isfinite(sum(v.sum().item() for v in out[0]["state"].values()))


def test_shards_are_whole_parameters_of_about_equal_size():
    assert cuts([10, 10, 10, 10], 2) == [2]
    assert cuts([100, 1, 1, 1], 2) == [1]
    assert cuts([1, 1, 1, 100], 3) == [2, 3]  # none empty
    flat = FlatModel(make_model(), extra=1, shards=3)
    assert sum(flat.sizes) == flat.numel and min(flat.sizes) > 0
    with pytest.raises(MicroDDPError, match="at least 7 parameters") as e:
        cuts([1] * 6, 7)
    assert "\n" not in str(e.value)


def test_too_few_ranks_for_the_servers_is_one_line():
    with pytest.raises(MicroDDPError, match="needs at least 3 ranks"):
        ps.PSConfig(steps=1, servers=2).check(2)
    with pytest.raises(MicroDDPError, match="ranks 0..1 are the servers"):
        ps.PSConfig(steps=1, servers=2, stragglers={1: 2.0}).check(4)
