"""DDP, ZeRO and the pipeline with CUDA tensors (issue 50), each against its reference in the
same test: microddp's DDP against torch's DDP, ZeRO stages 1-3 against plain data parallelism,
every pipeline schedule against one process. Marked `cuda`: skipped on a machine without a
GPU (conftest.py says why); where there is one, `python -m pytest -m cuda -n 0` runs them.

Two ranks. With two GPUs or more: NCCL, a GPU per rank (the device microddp picks from
LOCAL_RANK). With one: gloo with both ranks' tensors on that GPU (gloo moves CUDA tensors
through host memory), so one GPU checks the device handling, if not NCCL.
"""

import pytest
import torch
from torch import nn

import microddp as mdp
from microddp import pipeline, zero

pytestmark = pytest.mark.cuda

STEPS, BATCH, DIM = 3, 12, 16
TOL = {"atol": 1e-5, "rtol": 1e-5}  # CUDA kernels may pick other reduction orders per shape


def backend() -> str:
    return "nccl" if torch.cuda.device_count() >= 2 else "gloo"


def device(world) -> torch.device:
    return torch.device("cuda", world.rank % torch.cuda.device_count())


def model(dev) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4)).to(dev)


def batch(step: int, dev, world=None):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(BATCH, DIM, generator=g), torch.randint(0, 4, (BATCH,), generator=g)
    if world is not None:  # this rank's share
        share = BATCH // world.world_size
        x, y = x[world.rank * share:(world.rank + 1) * share], y[world.rank * share:
                                                                 (world.rank + 1) * share]
    return x.to(dev), y.to(dev)


def train(world, wrap) -> list[torch.Tensor]:
    dev = device(world)
    net = wrap(model(dev), dev)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(step, dev, world)
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return [p.detach().to("cpu", copy=True) for p in net.parameters()]


def ddp_pair(world):
    ours = train(world, lambda m, d: mdp.DDP(m, device_ids=[d.index]))
    theirs = train(world, lambda m, d: nn.parallel.DistributedDataParallel(
        m, device_ids=[d.index]))
    return ours, theirs, str(next(iter(ours)).device)


def test_ddp_with_cuda_tensors_equals_torchs_ddp():
    for ours, theirs, _ in mdp.spawn(ddp_pair, 2, backend=backend(), timeout=300):
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, **TOL)


def zero_stages(world):
    dev = device(world)
    reference = train(world, lambda m, d: mdp.DDP(m, device_ids=[d.index]))
    out = {}
    for stage in (1, 2, 3):
        net = model(dev)
        z = zero.Zero(net, torch.optim.SGD, stage=stage, lr=0.1, momentum=0.9)
        for step in range(STEPS):
            x, y = batch(step, dev, world)
            nn.functional.cross_entropy(z(x), y).backward()
            z.step()
            z.zero_grad()
        with z.gathered() as m:
            out[stage] = [p.detach().to("cpu", copy=True) for p in m.parameters()]
    return reference, out


def test_zero_with_cuda_tensors_equals_data_parallel():
    for reference, stages in mdp.spawn(zero_stages, 2, backend=backend(), timeout=300):
        for stage, params in stages.items():
            for a, b in zip(params, reference, strict=True):
                torch.testing.assert_close(a, b, **TOL, msg=f"ZeRO-{stage}")


def one_process(dev) -> list[torch.Tensor]:
    net = _pipeline_model(dev)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = _pipeline_batch(step, dev)
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return {n: p.detach().to("cpu", copy=True) for n, p in net.named_parameters()}


def _pipeline_model(dev) -> nn.Module:
    torch.manual_seed(0)
    return mdp.FullMLP(8, 8).to(dev)


def _pipeline_batch(step, dev):
    g = torch.Generator().manual_seed(1 + step)
    return (torch.randn(BATCH, 8, generator=g).to(dev),
            torch.randint(0, 2, (BATCH,), generator=g).to(dev))


def schedules(world):
    dev = device(world)
    out = {}
    for name in pipeline.BUILDERS:
        schedule = pipeline.build(name, world.world_size, 3, 2)
        net = _pipeline_model(dev)
        stages = pipeline.split_model(net, schedule.stages)
        mine = {s: stages[s] for s in schedule.stages_of(world.rank)}
        names = [n for s in mine for n in pipeline.stage_parameter_names(net, schedule.stages, s)]
        opt = torch.optim.SGD([q for s in mine.values() for q in s.parameters()], lr=0.1)
        named = dict(net.named_parameters())
        for step in range(STEPS):
            x, y = _pipeline_batch(step, dev)
            opt.zero_grad()
            pipeline.run_schedule(schedule, mine, x, y, nn.functional.cross_entropy)
            opt.step()
        out[name] = {n: named[n].detach().to("cpu", copy=True) for n in names}
    return out, one_process(dev)


def test_every_pipeline_schedule_with_cuda_tensors_equals_one_process():
    for out, reference in mdp.spawn(schedules, 2, backend=backend(), timeout=300):
        for name, params in out.items():
            assert params, name
            for n, p in params.items():
                torch.testing.assert_close(p, reference[n], **TOL, msg=f"{name} {n}")
