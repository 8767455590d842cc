"""microddp.zero.fully_shard against FSDP2's own, in the same test on 2 and 3 ranks: one unit
per layer and one for the root, the user's own optimizer over model.parameters(), the same
seed and data. Each step's loss, every parameter's local shard and its .grad after backward
(ours a plain tensor, FSDP2's DTensor.to_local(): the same rows), the optimizer state, and the
full parameters at the end are equal; with gradient accumulation (set_requires_gradient_sync)
and mixed precision (bf16 parameters, fp32 reduction) too. FSDP2 (torch 2.13, gloo) cannot
take the helpers' zero-sized parameter, so the model here has none."""

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import microddp as mdp
from microddp import zero
from zero_helpers import OPTIMIZERS, STEPS, fresh, groups, local, loss_fn

TOL = 1e-6


def local_of(t):
    return t.to_local() if hasattr(t, "to_local") else t


def run(world, shard, mp, name, micro, bf16):
    model = fresh(with_empty=False)
    policy = mp(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else mp()
    for layer in (model.a, model.b, model.c, model.frozen):
        shard(layer, mp_policy=policy)
    shard(model, mp_policy=policy)
    cls, kw = OPTIMIZERS[name]
    opt = cls(groups(model), **kw)
    losses, grads, shards, states = [], [], [], []
    for step in range(STEPS):
        for k in range(micro):
            model.set_requires_gradient_sync(k == micro - 1)
            x, y = local(world, step, micro, k)
            loss = loss_fn(model(x).float(), y) / micro
            loss.backward()
            losses.append(loss.item())
        grads.append([local_of(p.grad).clone() for p in model.parameters() if p.grad is not None])
        opt.step()
        opt.zero_grad()
        shards.append([local_of(p).detach().clone() for p in model.parameters()])
        states.append([{k: local_of(v).clone() for k, v in opt.state[p].items()}
                       for p in model.parameters() if p in opt.state])
    if hasattr(model, "full_state_dict"):
        full = [t for k, t in model.full_state_dict().items()]
    else:
        full = [v.full_tensor() if hasattr(v, "full_tensor") else v
                for v in model.state_dict().values()]
    return losses, grads, shards, states, full


def diff(a, b) -> float:
    if isinstance(a, torch.Tensor):
        if a.shape != b.shape:
            return float("inf")
        return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    if isinstance(a, dict):
        return max([diff(a[k], b[k]) for k in a] or [0.0]) if set(a) == set(b) else float("inf")
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return float("inf")
        return max([diff(x, y) for x, y in zip(a, b, strict=True)] or [0.0])
    return abs(a - b)


def both(world, cases):
    out = {}
    for name, micro, bf16 in cases:
        ours = run(world, zero.fully_shard, zero.MixedPrecisionPolicy, name, micro, bf16)
        ref = run(world, torch_fully_shard, TorchMP, name, micro, bf16)
        for i, what in enumerate(("losses", "grads", "shards", "optimizer state", "full")):
            out[name, micro, bf16, what] = diff(ours[i], ref[i])
    return out


CASES = [(name, 1, False) for name in OPTIMIZERS] + [("adam", 2, False), ("adamw", 1, True)]


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_fully_shard_equals_fsdp2(world_size):
    for out in mdp.spawn(both, world_size, (CASES,), backend="gloo", timeout=300):
        assert len(out) == 5 * len(CASES)
        bad = {k: v for k, v in out.items() if not v <= TOL}
        assert not bad, bad


def test_through_the_backend_as_through_shared_memory(monkeypatch):
    """MICRODDP_TRANSPORT=gloo: the units' all-gather and reduce-scatter go through gloo
    (as across hosts), not the host's shared memory; the same numbers as FSDP2's."""
    monkeypatch.setenv("MICRODDP_TRANSPORT", "gloo")
    for out in mdp.spawn(both, 2, ([("adam", 2, False)],), backend="gloo", timeout=300):
        bad = {k: v for k, v in out.items() if not v <= TOL}
        assert len(out) == 5 and not bad, bad
