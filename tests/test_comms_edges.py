"""The comms wrappers where torch.distributed has rules of its own: ranks outside a group,
tensors that require grad, and handles polled instead of waited on."""

import time
import warnings

import torch

import microddp as mdp
from microddp import comms


def _outside_a_group(world):
    """Ranks 0 and 1 form a group; rank 2, outside it, calls every wrapper on it."""
    warnings.simplefilter("ignore")  # torch warns about each skipped call on rank 2
    g = comms.new_group([0, 1])
    if world.rank < 2:
        t = torch.full((3,), float(world.rank + 1))
        comms.all_reduce(t, "avg", group=g)
        got = [torch.zeros(3), torch.zeros(3)]
        comms.all_gather(got, torch.full((3,), float(world.rank)), group=g)
        return t.tolist(), [x.tolist() for x in got]
    out = {}
    t = torch.full((3,), 5.0)
    out["all_reduce"] = (comms.all_reduce(t, "avg", group=g), t.tolist())
    out["async"] = (comms.all_reduce(t, "avg", group=g, async_op=True), t.tolist())
    out["reduce"] = (comms.reduce(t, 0, "avg", group=g), t.tolist())
    out["broadcast"] = (comms.broadcast(t, 0, group=g), t.tolist())
    lst = [torch.zeros(3), torch.zeros(3)]
    out["all_gather"] = (comms.all_gather(lst, t, group=g), [x.tolist() for x in lst])
    o = torch.zeros(3)
    out["reduce_scatter"] = (comms.reduce_scatter(o, [t, t], "avg", group=g), o.tolist())
    out["scatter"] = (comms.scatter(o, None, 0, group=g), o.tolist())
    out["gather"] = (comms.gather(t, None, 0, group=g), t.tolist())
    out["barrier"] = (comms.barrier(group=g, async_op=True), None)
    out["p2p"] = (comms.isend(t, 0, group=g), comms.irecv(o, 0, group=g),
                  comms.recv(o, 0, group=g), comms.send(t, 0, group=g), o.tolist())
    return out


def test_a_rank_outside_the_group_skips_every_call_as_torch_does():
    members, members2, outsider = mdp.spawn(_outside_a_group, 3, timeout=120)
    assert members == members2 == ([1.5] * 3, [[0.0] * 3, [1.0] * 3])
    for name in ("all_reduce", "async", "reduce", "broadcast", "gather"):
        assert outsider[name] == (None, [5.0] * 3), name  # not negated, not divided
    assert outsider["all_gather"] == (None, [[0.0] * 3, [0.0] * 3])
    assert outsider["reduce_scatter"] == outsider["scatter"] == (None, [0.0] * 3)
    assert outsider["barrier"] == (None, None)
    assert outsider["p2p"] == (None, None, -1, None, [0.0] * 3)


def _parameters(world):
    """avg on tensors that require grad, as torch's collectives write them in place."""
    p = torch.nn.Parameter(torch.full((3,), float(world.rank + 1)))
    version = p._version
    comms.all_reduce(p, "avg")
    q = torch.nn.Parameter(torch.full((3,), float(world.rank + 1)))
    comms.reduce(q, 0, "avg")
    t = torch.nn.Parameter(torch.full((3,), float(world.rank + 1)))
    torch_version = t._version
    torch.distributed.all_reduce(t)
    return (p.tolist(), p._version - version, t._version - torch_version,
            q.tolist() if world.rank == 0 else None, p.requires_grad)


def test_avg_works_on_parameters_and_leaves_the_version_as_torch_does():
    # (reduce_scatter is left out: gloo's own refuses an output that requires grad)
    for rank, (p, bumped, torch_bumped, q, grad) in enumerate(
            mdp.spawn(_parameters, 2, timeout=90)):
        assert p == [1.5] * 3 and grad is True
        assert bumped == torch_bumped == 0
        assert q == ([1.5] * 3 if rank == 0 else None)


def _poll(world):
    """Poll is_completed() instead of waiting: the result read must be the average."""
    t = torch.full((1000,), float(world.rank + 1))
    handle = comms.all_reduce(t, "avg", async_op=True)
    deadline = time.monotonic() + 30
    while not handle.is_completed() and time.monotonic() < deadline:
        time.sleep(0.001)
    polled = t[:2].tolist()
    handle.wait()
    waited = t[:2].tolist()
    u = torch.full((4,), float(world.rank + 1))
    fut = comms.all_reduce(u, "avg", async_op=True).get_future()
    value = [x.tolist() for x in fut.wait()]
    v = torch.full((4,), float(world.rank + 1))
    h = comms.all_reduce(v, "avg", async_op=True)
    fut2 = h.get_future()
    h.wait()  # both the future's callback and wait() see it finish: one division only
    fut2.wait()
    return polled, waited, value, u.tolist(), v.tolist()


def test_a_handle_is_completed_only_once_avg_is_divided():
    for polled, waited, value, u, v in mdp.spawn(_poll, 2, timeout=90):
        assert polled == waited == [1.5, 1.5]
        assert value == [[1.5] * 4] and u == [1.5] * 4 and v == [1.5] * 4


def test_a_world_of_one_gives_finished_futures():
    mdp.init()
    t = torch.tensor([3.0, 4.0])
    fut = comms.all_reduce(t, "avg", async_op=True).get_future()
    assert fut.done() and fut.wait() == [t]
    out = [torch.zeros(2)]
    assert comms.all_gather(out, t, async_op=True).get_future().wait() == out
    assert torch.equal(out[0], t)
