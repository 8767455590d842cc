"""What the pipeline tests share: one problem, trained K steps by one process or by a pipeline."""

import torch
from torch import nn

import microddp as mdp
from microddp import pipeline

DIM, DEPTH, BATCH, STEPS, LR = 8, 8, 11, 3, 0.1
loss_fn = nn.functional.cross_entropy


def data(batch: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, batch, DIM, generator=g), torch.randint(0, 2, (STEPS, batch),
                                                                     generator=g)


def fresh_model() -> mdp.FullMLP:
    torch.manual_seed(0)
    return mdp.FullMLP(DIM, DEPTH)


def one_process(batch: int = BATCH) -> tuple[dict, dict, list[float]]:
    """Parameters after STEPS SGD steps, the last step's gradients, and every step's loss."""
    model, (xs, ys) = fresh_model(), data(batch)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in zip(xs, ys, strict=True):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(loss.item())
        grads = {n: q.grad.clone() for n, q in model.named_parameters()}
        opt.step()
    return {n: q.detach().clone() for n, q in model.named_parameters()}, grads, losses


def pipelined(world, name: str, m: int, v: int = 2, batch: int = BATCH):
    """The same training with this rank's stages of schedule `name` over the world's ranks."""
    schedule = pipeline.build(name, world.world_size, m, v)
    model, (xs, ys) = fresh_model(), data(batch)
    stages = pipeline.split_model(model, schedule.stages)
    mine = {s: stages[s] for s in schedule.stages_of(world.rank)}
    names = [n for s in mine for n in pipeline.stage_parameter_names(model, schedule.stages, s)]
    opt = torch.optim.SGD([q for s in mine.values() for q in s.parameters()], lr=LR)
    named, losses = dict(model.named_parameters()), []
    for x, y in zip(xs, ys, strict=True):
        opt.zero_grad()
        losses.append(pipeline.run_schedule(schedule, mine, x, y, loss_fn))
        grads = {n: named[n].grad.clone() for n in names}
        opt.step()
    return {n: named[n].detach().clone() for n in names}, grads, losses
