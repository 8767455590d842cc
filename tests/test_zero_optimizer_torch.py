"""microddp.zero.ZeroRedundancyOptimizer against torch's own, in the same test on 2 and 3
ranks: the same model (sizes no world size divides, a frozen layer, a zero-sized parameter, two
parameter groups), seed and data, under torch's DDP and microddp's, with and without bucket
views: the losses, the gradients each step, the parameters, and the consolidated state dicts
(torch's layout, full-shaped per parameter index) are equal; a state dict saved by either
class loads into the other and training goes on to the same parameters."""

import copy

import pytest
import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

import microddp as mdp
from microddp import zero
from zero_helpers import OPTIMIZERS, STEPS, fresh, groups, local, loss_fn

TOL = 1e-6


def train(world, make_ddp, make_opt, name, bucket_view, state=None):
    ddp = make_ddp(fresh())
    cls, kw = OPTIMIZERS[name]
    opt = make_opt(groups(ddp.module), optimizer_class=cls, parameters_as_bucket_view=bucket_view,
                   **kw)
    if state is not None:
        opt.load_state_dict(state)
    losses, grads = [], []
    for step in range(STEPS):
        x, y = local(world, step)
        loss = loss_fn(ddp(x), y)
        loss.backward()
        losses.append(loss.item())
        grads.append([p.grad.clone() for p in ddp.module.parameters() if p.grad is not None])
        opt.step()
        opt.zero_grad()
    opt.consolidate_state_dict(to=0)
    sd = opt.state_dict() if world.rank == 0 else None
    return losses, grads, [p.detach().clone() for p in ddp.module.parameters()], sd, opt


def diff(a, b) -> float:
    """Largest difference between two nests of tensors, numbers, lists and dicts; inf if
    their shapes or keys differ."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.shape != b.shape:
            return float("inf")
        return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            return float("inf")
        return max([diff(a[k], b[k]) for k in a] or [0.0])
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return float("inf")
        return max([diff(x, y) for x, y in zip(a, b, strict=True)] or [0.0])
    return 0.0 if a == b else float("inf")


def both(world):
    torch_ddp = nn.parallel.DistributedDataParallel
    out = {}
    for name in OPTIMIZERS:
        for bucket_view in (False, True):
            ref = train(world, torch_ddp, TorchZero, name, bucket_view)
            saved = {}
            for ddp_name, ddp in (("torch DDP", torch_ddp), ("microddp DDP", mdp.DDP)):
                ours = train(world, ddp, zero.ZeroRedundancyOptimizer, name, bucket_view)
                for i, what in enumerate(("losses", "grads", "params", "state_dict")):
                    out[name, bucket_view, ddp_name, what] = diff(ours[i], ref[i])
                saved[ddp_name] = ours[3]
            # a state saved by one class loads into the other; training goes on alike (torch's
            # load_state_dict drops other ranks' entries from the dict it is given: one each)
            b = train(world, torch_ddp, TorchZero, name, bucket_view, _broadcast_object(ref[3]))
            a = train(world, torch_ddp, zero.ZeroRedundancyOptimizer, name, bucket_view,
                      _broadcast_object(ref[3]))
            out[name, bucket_view, "ours after loading torch's state", "params"] = diff(a[2], b[2])
            c = train(world, torch_ddp, TorchZero, name, bucket_view,
                      _broadcast_object(saved["torch DDP"]))
            out[name, bucket_view, "torch's after loading ours", "params"] = diff(c[2], b[2])
    return out


def _broadcast_object(obj):
    box = [copy.deepcopy(obj)]  # the source rank's own object otherwise
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_zero_redundancy_optimizer_equals_torchs(world_size):
    for out in mdp.spawn(both, world_size, backend="gloo", timeout=300):
        bad = {k: v for k, v in out.items() if not v <= TOL}
        assert not bad, bad
        assert len(out) == 3 * 2 * (2 * 4 + 2)
