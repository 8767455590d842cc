"""Memory and traffic, measured from the live tensors and counted as sent, on 3 ranks with
Adam: each stage cuts what the ZeRO paper says it cuts, to 1/N of plain data parallelism's,
and sends what it says (2x the parameters for ZeRO-1/2, 3x for ZeRO-3, times (N-1)/N)."""

import pytest
import torch

import microddp as mdp
from microddp import MicroDDPError, zero

DIM, DEPTH, BATCH = 64, 4, 12


def batch(world, step):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(BATCH, DIM, generator=g), torch.randint(0, 2, (BATCH,), generator=g)
    share = BATCH // world.world_size
    return x[world.rank * share:(world.rank + 1) * share], y[world.rank * share:(world.rank + 1) * share]


def loss(model, world, step):
    x, y = batch(world, step)
    return torch.nn.functional.cross_entropy(model(x), y)


def measured(world):
    torch.manual_seed(0)
    ddp = mdp.DDP(mdp.FullMLP(DIM, DEPTH), bucket_cap_mb=0.01)
    counter = zero.CountingAllReduce()
    ddp.register_comm_hook(None, counter)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    out = {}
    for step in range(2):
        loss(ddp, world, step).backward()
        out["dp"] = zero.measure(ddp.module, opt)  # at the step, as Zero.memory() measures
        opt.step()
        opt.zero_grad()
        counter.end_step()
    out["dp"]["sent_per_step"] = counter.last_step
    for stage in zero.STAGES:
        torch.manual_seed(0)
        z = zero.Zero(mdp.FullMLP(DIM, DEPTH), torch.optim.Adam, stage=stage,
                      bucket_cap_mb=0.01, lr=1e-3)
        for step in range(2):
            loss(z, world, step).backward()
            z.step()
            z.zero_grad()
        out[stage] = z.memory()
        out[stage, "between steps"] = z.measure_now()
        # the packed gradients beyond the shard: the most held at once during backward, and
        # the largest one bucket's packing needs (its other ranks' parts)
        # (at most all of them, if no bucket's reduce completed before backward ended)
        rest = [(b.numel - b.sizes[world.rank]) * 4 for b in z.plan.buckets]
        out[stage, "packed"] = (z.reducer.peak_packed_bytes, max(rest), sum(rest))
        if stage < 3:  # the shard the optimizer steps is this rank's part of the flat buffer
            b = z.plan.buckets[0]
            shard, flat = z.shards.params[b.index], z.flats[b.index]
            out[stage, "shard in place"] = (
                shard.data_ptr() == flat[b.start(world.rank):].data_ptr()
                and shard.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr())
    params = sum(p.numel() * 4 for p in ddp.module.parameters())
    return out, params


def test_each_stage_shards_what_it_says_measured():
    n = 3
    for out, p in mdp.spawn(measured, n, backend="gloo", timeout=120):
        dp = out["dp"]
        assert dp["params"] == p and dp["grads"] == p
        assert dp["optimizer_state"] == pytest.approx(2 * p, rel=0.01)  # Adam's two moments
        assert dp["sent_per_step"] == pytest.approx(2 * (n - 1) / n * p, rel=0.01)
        for stage in zero.STAGES:
            m = out[stage]
            assert m["optimizer_state"] == pytest.approx(dp["optimizer_state"] / n, rel=0.01)
            # ZeRO-1 keeps the full gradients, and its averaged shard arrives beside them
            # during backward; ZeRO-2/3 keep only the shard
            assert m["grads"] == pytest.approx(p + p / n if stage == 1 else p / n,
                                               rel=0.01), stage
            # ZeRO-1/2 keep the full parameters, their shard a view of them; ZeRO-3 the shard
            assert m["params"] == (p if stage < 3 else pytest.approx(p / n, rel=0.01))
            if stage < 3:
                assert out[stage, "shard in place"]
            peak, biggest, everything = out[stage, "packed"]
            assert biggest <= peak <= everything
            factor = 3 if stage == 3 else 2
            assert m["sent_per_step"] == pytest.approx(factor * (n - 1) / n * p, rel=0.01)
        between = out[3, "between steps"]
        assert between["params"] == pytest.approx(p / n, rel=0.01) and between["grads"] == 0


def test_mistakes_are_one_clear_error():
    torch.manual_seed(0)
    model = mdp.FullMLP(4, 1)
    with pytest.raises(MicroDDPError, match="stage must be 1, 2 or 3"):
        zero.Zero(model, torch.optim.Adam, stage=4)
    with pytest.raises(MicroDDPError, match="LBFGS"):
        zero.Zero(model, torch.optim.LBFGS)
    mixed = mdp.FullMLP(4, 1)
    mixed.net[-1].to(torch.float64)
    with pytest.raises(MicroDDPError, match="torch.float32 on cpu and torch.float64 on cpu"):
        zero.Zero(mixed, torch.optim.Adam)
    with pytest.raises(MicroDDPError, match="torch.optim.Optimizer class"):
        zero.Zero(model, torch.optim.Adam(model.parameters()))
    with pytest.raises(MicroDDPError, match="in no parameter group"):
        zero.Zero(model, torch.optim.Adam, param_groups=[model.net[0].weight])
    with pytest.raises(MicroDDPError, match="two parameter groups"):
        zero.Zero(model, torch.optim.Adam, param_groups=[
            {"params": list(model.parameters())}, {"params": [model.net[0].weight]}])
    with pytest.raises(MicroDDPError, match="not a parameter of the module"):
        zero.Zero(model, torch.optim.Adam, param_groups=[torch.zeros(2, requires_grad=True)])
    with pytest.raises(MicroDDPError, match="could not build SGD"):
        zero.Zero(model, torch.optim.SGD, nesterov=True)
    z = zero.Zero(model, torch.optim.Adam, stage=2, lr=0.1)
    with pytest.raises(MicroDDPError, match="call it after a step"):
        z.memory()
    with z.no_sync(), pytest.raises(MicroDDPError, match="inside no_sync"):
        z.step()
