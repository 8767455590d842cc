"""DDP over a process group it is given, with no default group (issue 50): a Python
`ProcessGroup` (torch's test_c10d_pypg.py builds such groups) or a gloo group built directly
from a store. torch's DDP talks through the group it is handed; microddp's used to try to form
a world of its own ("MASTER_PORT is not set"). Each case trains microddp's and torch's DDP
side by side in the same ranks, against the same group, and checks that the group's own
methods carried the calls."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import _create_work_from_future

import microddp as mdp

ENGINES = ("microddp", "torch")


class Counting(dist.ProcessGroup):
    """A Python ProcessGroup over another group, counting the calls that reach it."""

    def __init__(self, inner):
        super().__init__(inner.rank(), inner.size())
        self.inner, self.calls = inner, {}

    def _count(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1

    def allreduce(self, tensors, opts):
        self._count("allreduce")
        return self.inner.allreduce(tensors, opts)

    def broadcast(self, tensors, opts):
        self._count("broadcast")
        return self.inner.broadcast(tensors, opts)

    def allgather(self, outputs, inputs, opts):
        self._count("allgather")
        return self.inner.allgather(outputs, inputs, opts)

    def getBackendName(self):
        return "counting"


class Lonely(dist.ProcessGroup):
    """A one-rank Python ProcessGroup whose calls finish at once (test_c10d_pypg's shape)."""

    def __init__(self):
        super().__init__(0, 1)
        self.calls = {}

    def _done(self, name, result):
        self.calls[name] = self.calls.get(name, 0) + 1
        fut = torch.futures.Future()
        fut.set_result(result)
        return _create_work_from_future(fut)

    def allreduce(self, tensors, opts):
        return self._done("allreduce", tensors)

    def broadcast(self, tensors, opts):
        return self._done("broadcast", tensors)

    def allgather(self, outputs, inputs, opts):
        for out, t in zip(outputs[0], inputs, strict=True):
            out.copy_(t)
        return self._done("allgather", outputs)

    def getBackendName(self):
        return "lonely"


def model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 2))


def train(engine, group, rank, **kwargs):
    torch.manual_seed(100 + rank)  # different starting weights: the broadcast must fix them
    net = model() if rank == 0 else nn.Sequential(*(m for m in model()))
    if rank:
        for p in net.parameters():
            p.data.add_(torch.randn_like(p))
    cls = mdp.DDP if engine == "microddp" else nn.parallel.DistributedDataParallel
    ddp = cls(net, process_group=group, **kwargs)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(4):
        g = torch.Generator().manual_seed(10 * step + rank)
        opt.zero_grad()
        ddp(torch.randn(6, 5, generator=g)).pow(2).sum().backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


def gloo_group(store, rank):
    """A ProcessGroup over gloo built as torch builds one, but not registered with torch."""
    group = dist.ProcessGroup(store, rank, 2)
    gloo = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=60))
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    return group


def two_ranks(rank):
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 2,
                          rank == 0, timeout=timedelta(seconds=60))
    out = {}
    for kind in ("python group", "gloo group"):
        for view in (False, True):
            params, calls = {}, {}
            for engine in ENGINES:
                prefix = dist.PrefixStore(f"{kind}/{view}/{engine}", store)
                group = gloo_group(prefix, rank)
                if kind == "python group":
                    group = Counting(group)
                params[engine] = train(engine, group, rank, gradient_as_bucket_view=view)
                calls[engine] = dict(getattr(group, "calls", {}))
            out[kind, view] = (all(torch.equal(a, b) for a, b in
                                   zip(params["microddp"], params["torch"], strict=True)),
                               calls["microddp"])
    out["initialized"] = dist.is_initialized()
    return out


def test_ddp_over_a_given_group_without_a_default_group_trains_as_torch():
    for out in mdp.spawn(two_ranks, 2, join=False, timeout=180):
        assert out.pop("initialized") is False  # no default group was ever formed
        for case, (equal, calls) in out.items():
            assert equal, case
            if case[0] == "python group":  # the group's own methods carried the calls
                assert calls.get("allreduce", 0) >= 4 and calls.get("broadcast", 0) >= 1, calls


def test_ddp_over_a_lonely_python_group_calls_it_and_matches_local_training():
    got = {}
    for engine in ENGINES:
        group = Lonely()
        torch.manual_seed(123)
        net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        x = torch.rand(2)
        ddp = (mdp.DDP if engine == "microddp" else nn.parallel.DistributedDataParallel)(
            net, process_group=group)
        ddp(x).sum().backward()
        grads = [p.grad.clone() for p in net.parameters()]
        net.zero_grad()
        net(x).sum().backward()
        got[engine] = ([torch.equal(a, p.grad) for a, p in zip(grads, net.parameters(),
                                                               strict=True)],
                       group.calls.get("allreduce", 0) > 0)
    assert not dist.is_initialized()
    assert got["microddp"] == got["torch"] == ([True, True], True)
