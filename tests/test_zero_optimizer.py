"""ZeroRedundancyOptimizer's behaviours, as torch's test_zero_redundancy_optimizer.py checks
its own on CPU (re-expressed here, with our numbers worked out by hand): the state dict's
layout and values, reload with the saved lr, lr schedulers, step(closure) and step(**kwargs),
keys an inner optimizer adds, zero_grad, the constructor's checks and exception types,
add_param_group against groups given up front and against the unsharded optimizer, a
non-default process group, maximize, and what it refuses (one line each)."""

import pytest
import torch
from torch import nn

import microddp as mdp
from microddp import zero
from microddp.errors import MicroDDPError

Z = zero.ZeroRedundancyOptimizer


def test_state_dict_layout_values_and_reload_in_a_world_of_one():
    x = torch.tensor([1.0], requires_grad=True)
    o = Z([x], optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9)
    x.backward()
    o.step()
    assert torch.equal(x.detach(), torch.tensor([0.9]))
    o.zero_grad()
    assert x.grad is None
    with pytest.raises(MicroDDPError, match="consolidate_state_dict"):
        o.state_dict()
    o.consolidate_state_dict(to=0)
    sd = o.state_dict()
    assert torch.equal(sd["state"][0]["momentum_buffer"], torch.tensor([1.0]))
    group = sd["param_groups"][0]
    assert (group["params"], group["lr"], group["momentum"], group["nesterov"],
            group["weight_decay"], group["dampening"]) == ([0], 0.1, 0.9, False, 0, 0)
    assert {k: v for k, v in o.param_groups[0].items() if k != "params"} == \
        {k: v for k, v in group.items() if k != "params"}
    o = Z([x], optimizer_class=torch.optim.SGD, lr=0.01)
    o.load_state_dict(sd)
    assert o.param_groups[0]["lr"] == 0.1  # the saved lr, not the constructor's
    x.backward()
    o.step()
    # momentum 0.9 * 1 + grad 1 = 1.9; 0.9 - 0.1 * 1.9 = 0.71
    assert torch.allclose(x.detach(), torch.tensor([0.71]))


def test_lr_scheduler_kwargs_inner_keys_and_closures():
    x, x2 = (torch.tensor([1.0], requires_grad=True) for _ in range(2))
    o, o2 = Z([x], optimizer_class=torch.optim.SGD, lr=0.01), torch.optim.SGD([x2], lr=0.01)
    s, s2 = (torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) for opt in (o, o2))
    for _ in range(5):
        for t, opt, sched in ((x, o, s), (x2, o2, s2)):
            opt.zero_grad()
            t.backward()
            opt.step()
            sched.step()
        assert torch.equal(x, x2)

    class WithKwarg(torch.optim.SGD):
        def step(self, closure=None, kwarg=None):
            super().step()
            kwarg.append(5)

    class NewKey(torch.optim.SGD):
        def step(self, closure=None):
            super().step()
            self.param_groups[0]["new_key"] = 0.1

    class NoClosure(torch.optim.SGD):
        def step(self):
            return super().step()

    got: list = []
    for cls, call in ((WithKwarg, lambda o: o.step(0, kwarg=got)), (NewKey, Z.step),
                      (NoClosure, Z.step)):
        x = torch.tensor([1.0], requires_grad=True)
        o = Z([x], optimizer_class=cls, lr=0.1)
        x.backward()
        call(o)
        assert torch.allclose(x.detach(), torch.tensor([0.9])), cls
    assert got == [5] and o.param_groups[0].get("new_key") is None
    x = torch.tensor([1.0], requires_grad=True)
    o = Z([x], optimizer_class=NewKey, lr=0.1)
    x.backward()
    o.step()
    assert o.param_groups[0]["new_key"] == 0.1


def test_constructor_checks_and_exception_types():
    m = nn.Sequential(nn.Linear(5, 10), nn.Linear(10, 10), nn.Linear(10, 10))
    for bad, kind in (([], ValueError), (torch.randn(1), TypeError), (1.2, TypeError),
                      (list(m.parameters()) + [42], TypeError),
                      ([torch.zeros(1), torch.zeros(1, dtype=torch.float64)], ValueError),
                      ([torch.sparse_coo_tensor(size=(2, 3))], ValueError)):
        with pytest.raises(kind) as e:
            Z(bad, optimizer_class=torch.optim.SGD, lr=0.01)
        assert isinstance(e.value, MicroDDPError) and "\n" not in str(e.value)
    for ok in (m.parameters(), list(m.parameters()),
               [{"params": [lin.weight for lin in m]}, {"params": [lin.bias for lin in m]}]):
        Z(ok, optimizer_class=torch.optim.SGD, lr=0.01)
    o = Z([{"params": [lin.weight for lin in m], "weight_decay": 0.0},
           {"params": [lin.bias for lin in m], "weight_decay": 0.01}],
          optimizer_class=torch.optim.AdamW, lr=0.01, betas=(0.9, 0.999), eps=1e-8)
    assert len(o.param_groups) == len(o.optim.param_groups) == 2
    for cls in (torch.optim.LBFGS, torch.optim.SparseAdam):
        with pytest.raises(MicroDDPError, match="element-wise"):
            Z(m.parameters(), optimizer_class=cls, lr=0.01)
    with pytest.raises(MicroDDPError, match="overlap_with_ddp"):
        Z(m.parameters(), optimizer_class=torch.optim.SGD, overlap_with_ddp=True, lr=0.01)


def test_changed_trainability_refuses_the_step():
    m = nn.Linear(3, 2)
    o = Z(m.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    m.bias.requires_grad_(False)
    m(torch.ones(1, 3)).sum().backward()
    with pytest.raises(MicroDDPError, match="requires_grad changed"):
        o.step()


def distributed(world):
    out = {}
    # sharding: every rank holds about 1/N of the elements, whatever the sizes
    sizes = [9, 7, 5, 3]
    params = [torch.rand(s, 1, requires_grad=True) for s in sizes * world.world_size]
    o = Z(params, optimizer_class=torch.optim.SGD, lr=0.01)
    out["owned"] = sum(p.numel() for g in o.optim.param_groups for p in g["params"])
    # add_param_group: groups up front == added after == the unsharded optimizer (AdamW)
    torch.manual_seed(0)
    m1 = nn.Sequential(nn.Linear(5, 10), nn.Linear(10, 10), nn.Linear(10, 5))
    m2, m3 = (nn.Sequential(*[nn.Linear(lin.in_features, lin.out_features) for lin in m1])
              for _ in range(2))
    m2.load_state_dict(m1.state_dict())
    m3.load_state_dict(m1.state_dict())
    o1 = Z([{"params": [lin.weight for lin in m1], "weight_decay": 0.0},
            {"params": [lin.bias for lin in m1], "weight_decay": 0.01}],
           optimizer_class=torch.optim.AdamW, lr=0.01)
    o2 = Z([lin.weight for lin in m2], optimizer_class=torch.optim.AdamW, lr=0.01,
           weight_decay=0.0, parameters_as_bucket_view=True)
    o2.add_param_group({"params": [lin.bias for lin in m2], "weight_decay": 0.01})
    o3 = torch.optim.AdamW([{"params": [lin.weight for lin in m3], "weight_decay": 0.0},
                            {"params": [lin.bias for lin in m3], "weight_decay": 0.01}], lr=0.01)
    torch.manual_seed(1)  # the same inputs on every rank: the gradients need no averaging
    for _ in range(3):
        x = torch.randn(8, 5)
        for m, o in ((m1, o1), (m2, o2), (m3, o3)):
            o.zero_grad()
            m(x).sum().backward()
            o.step()
    out["add_param_group"] = max((a - b).abs().max().item()
                                 for ma in (m1, m2)
                                 for a, b in zip(ma.parameters(), m3.parameters(), strict=True))
    # step(closure) on gradients averaged by hand, maximize, bucket views on and off
    for bucket_view in (False, True):
        for maximize in (False, True):
            m = nn.Linear(1, 1)
            with torch.no_grad():
                m.weight.fill_(1.0)
                m.bias.fill_(2.0)
            o = Z(m.parameters(), optimizer_class=torch.optim.SGD, lr=0.1,
                  parameters_as_bucket_view=bucket_view, maximize=maximize)
            x = torch.tensor([float(world.rank + 1)])
            target = x + 3.0

            def closure(o=o, m=m, x=x, target=target):
                o.zero_grad()
                loss = nn.functional.l1_loss(m(x), target)
                loss.backward()
                for p in m.parameters():
                    mdp.comms.all_reduce_mean(p.grad)
                return loss

            loss = o.step(closure)
            sign = -1 if maximize else 1
            # d|w x + b - (x + 3)|/dw = -x (the output is below the target), averaged over
            # ranks' x = 1..N; d/db = -1
            mean_x = (world.world_size + 1) / 2
            out["closure", bucket_view, maximize] = (
                loss.item(), m.weight.item() - (1.0 + sign * 0.1 * mean_x),
                m.bias.item() - (2.0 + sign * 0.1))
    # a process group of ranks 0 and 2 (global ranks differ from group ranks)
    group = mdp.comms.new_group([0, 2])
    if world.rank in (0, 2):
        torch.manual_seed(5)
        m = nn.Linear(4, 3)
        o = Z(m.parameters(), optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9,
              process_group=group)
        torch.manual_seed(10 + world.rank)  # different data on each rank
        for _ in range(3):
            o.zero_grad()
            m(torch.randn(2, 4)).pow(2).sum().backward()
            for p in m.parameters():
                mdp.comms.all_reduce_mean(p.grad, group=group)
            o.step()
        flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
        each = [torch.empty_like(flat) for _ in range(2)]
        mdp.comms.all_gather(each, flat, group=group)
        out["group"] = (each[0] - each[1]).abs().max().item()
        out["group owned"] = o.optim.param_groups[0]["params"][0].numel() + \
            o.optim.param_groups[0]["params"][1].numel()
    return out


def test_sharding_groups_closure_and_a_process_group_on_three_ranks():
    for rank, out in enumerate(mdp.spawn(distributed, 3, backend="gloo", timeout=120)):
        assert out["owned"] == sum([9, 7, 5, 3])
        assert out["add_param_group"] <= 1e-6
        for bucket_view in (False, True):
            for maximize in (False, True):
                loss, dw, db = out["closure", bucket_view, maximize]
                assert loss == pytest.approx(1.0) and abs(dw) < 1e-6 and abs(db) < 1e-6
        if rank in (0, 2):
            assert out["group"] == 0.0
            assert out["group owned"] == 15 // 2 + (rank == 0)  # 12 + 3 elements over 2 ranks
        else:
            assert "group" not in out
