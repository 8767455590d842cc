"""Every stage of the ladder trains to the monolith's parameters (same global batch, same seed),
on 1, 2, 3 and 4 ranks; so does every engine of `microddp.dp.wrap`, with and without no_sync."""

import pytest
import torch
from torch import nn

import microddp as mdp
from microddp import MicroDDPError
from microddp.dp import ladder as stages
from microddp.dp import wrap
from microddp.dp.ladder import shard, toy_data

DIM, DEPTH, BATCH, STEPS, LR = 16, 4, 24, 3, 0.1
CAP_MB = 0.001  # about 1 KB: several buckets even for this small model
loss_fn = nn.functional.cross_entropy


def fresh():
    torch.manual_seed(0)
    model = mdp.FullMLP(DIM, DEPTH)
    return model, torch.optim.SGD(model.parameters(), lr=LR)


def batches():
    x, y = toy_data(BATCH * STEPS, DIM, seed=1)
    return list(zip(x.chunk(STEPS), y.chunk(STEPS), strict=True))


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def monolith():
    model, opt = fresh()
    for x, y in batches():
        stages.monolith_step(model, opt, loss_fn, x, y)
    return params(model)


def local(world, x, y):
    return shard(x, world.rank, world.world_size), shard(y, world.rank, world.world_size)


def ladder(world):
    """Stages 3-6 as the course runs them, each from the same start."""
    out = {}
    model, opt = fresh()
    for x, y in batches():
        stages.naive_step(model, opt, loss_fn, *local(world, x, y))
    out["naive"] = params(model)
    for name, make in [("hooks", lambda m: stages.GradHooks(m.parameters())),
                       ("buckets", lambda m: stages.BucketHooks(m.parameters(), CAP_MB)),
                       ("overlap", lambda m: stages.OverlapHooks(m.parameters(), CAP_MB))]:
        model, opt = fresh()
        hooks = make(model)
        for x, y in batches():
            stages.monolith_step(model, opt, loss_fn, *local(world, x, y))
        hooks.remove()
        out[name] = params(model)
    return out


def engines(world):
    """Every wrap() engine; the last step accumulates two half batches, the first under no_sync."""
    out = {}
    names = ["naive", "hooks", "buckets", "overlap", "microddp"]
    names += ["torch"] if world.distributed else []
    for engine in names:
        model, opt = fresh()
        kwargs = {"bucket_cap_mb": CAP_MB} if engine != "naive" else {}
        ddp = wrap(model, engine, **kwargs)
        for i, (x, y) in enumerate(batches()):
            xs, ys = local(world, x, y)
            opt.zero_grad()
            if i < STEPS - 1:
                loss_fn(ddp(xs), ys).backward()
            else:
                half = xs.shape[0] // 2
                with ddp.no_sync():
                    (loss_fn(ddp(xs[:half]), ys[:half]) / 2).backward()
                (loss_fn(ddp(xs[half:]), ys[half:]) / 2).backward()
            opt.step()
        out[engine] = params(model)
    return out


def run_all(world):
    return ladder(world), engines(world)


def max_rel_diff(a, b):
    return max(((p - q).abs().max() / q.abs().max()).item() for p, q in zip(a, b, strict=True))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_stage_and_engine_matches_the_monolith(world_size):
    ref = monolith()
    if world_size == 1:  # a world of one process needs no process group: run it right here
        results = [run_all(mdp.init())]
    else:
        results = mdp.spawn(run_all, world_size, timeout=120)
    for ladder_out, engine_out in results:
        for name, got in {**ladder_out, **engine_out}.items():
            assert max_rel_diff(got, ref) < 1e-5, name
    # replicas never drift apart: every rank holds bit-identical parameters
    for ladder_out, engine_out in results[1:]:
        for name, got in {**ladder_out, **engine_out}.items():
            base = {**results[0][0], **results[0][1]}[name]
            assert all(torch.equal(p, q) for p, q in zip(got, base, strict=True)), name


def test_manual_two_replicas_match_the_monolith():
    ref = monolith()
    pairs = [fresh() for _ in range(2)]
    replicas, opts = [m for m, _ in pairs], [o for _, o in pairs]
    for x, y in batches():
        stages.manual_step(replicas, opts, loss_fn, x, y)
    assert max_rel_diff(params(replicas[0]), ref) < 1e-5
    assert all(torch.equal(p, q) for p, q in zip(params(replicas[0]), params(replicas[1]), strict=True))


def batchnorm_buffers(world):
    """Running statistics after three train-mode forwards on rank-dependent data."""
    out = {}
    for engine in ("naive", "overlap", "torch"):
        torch.manual_seed(0)
        ddp = wrap(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), engine)
        for step in range(3):
            ddp(torch.randn(8, 4, generator=torch.Generator().manual_seed(step)) * (1 + world.rank))
        out[engine] = ddp.module[1].running_var.clone()
    return out


def test_stage_engines_sync_buffers_from_rank_0_before_each_forward_as_torch():
    for out in mdp.spawn(batchnorm_buffers, 2, timeout=60):
        assert torch.allclose(out["naive"], out["torch"]) and torch.equal(out["naive"], out["overlap"])


def test_wrap_rejects_unknown_engines_and_arguments():
    with pytest.raises(MicroDDPError, match="'hooks' does not implement static_graph=True"):
        wrap(mdp.FullMLP(4, 1), "hooks", static_graph=True)
    with pytest.raises(MicroDDPError, match="unknown engine 'ring'"):
        wrap(mdp.FullMLP(4, 1), "ring")
    with pytest.raises(MicroDDPError, match="does not take colour"):
        wrap(mdp.FullMLP(4, 1), "hooks", colour=3)
    with pytest.raises(MicroDDPError, match="needs a process group"):
        wrap(mdp.FullMLP(4, 1), "torch")


def test_shard_refuses_uneven_batches():
    with pytest.raises(ValueError, match="does not split evenly"):
        shard(torch.zeros(5), 0, 2)
