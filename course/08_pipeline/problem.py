"""What chapter 8's scripts share: the model, the data, and a clock for each rank's work
(imported by the scripts next to it)."""

import time

import torch
from torch import nn

import microddp as mdp
from microddp import comms, pipeline

DIM, DEPTH, BATCH, LR = 16, 8, 24, 0.1
loss_fn = nn.functional.cross_entropy


def fresh_model() -> mdp.FullMLP:
    torch.manual_seed(0)  # every rank builds the same model, then keeps its own stages
    return mdp.FullMLP(DIM, DEPTH)


def batch(size: int = BATCH, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1 + step)
    return torch.randn(size, DIM, generator=g), torch.randint(0, 2, (size,), generator=g)


def one_process(steps: int, size: int = BATCH) -> dict[str, torch.Tensor]:
    """The reference: `steps` SGD steps of the whole model in one process, on the batches
    every pipelined run of this chapter uses; its parameters."""
    model = fresh_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        x, y = batch(size, step)
        opt.zero_grad()
        loss_fn(model(x), y).backward()  # the mean over the whole batch
        opt.step()
    return {n: q.detach() for n, q in model.named_parameters()}


class Sleep(torch.autograd.Function):
    """A layer that does nothing but take time: `cost` seconds forward, twice that backward.

    On a shared 2-core machine real compute would fight for the cores; sleeping ranks do not,
    so the timeline shows the schedule's shape and not the machine's load.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, cost: float) -> torch.Tensor:
        ctx.cost = cost
        time.sleep(cost)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(2 * ctx.cost)
        return grad, None


class Slow(nn.Module):
    """A stage followed by a Sleep: the same numbers, at a known cost."""

    def __init__(self, stage: nn.Module, cost: float) -> None:
        super().__init__()
        self.stage, self.cost = stage, cost

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Sleep.apply(self.stage(x), self.cost)


def timed_step(world: mdp.World, name: str, m: int, cost: float = 0.0):
    """One step of schedule `name` on this rank: (kind, start, end) of each compute action.

    time.perf_counter() is one clock for all the processes of a host, so the ranks' lists,
    gathered by mdp.spawn, line up on one timeline.
    """
    schedule = pipeline.build(name, world.world_size, m)
    stages = pipeline.split_model(fresh_model(), schedule.stages)
    mine = {s: Slow(stages[s], cost) if cost else stages[s]
            for s in schedule.stages_of(world.rank)}
    x, y = batch()
    pipeline.run_schedule(schedule, mine, x, y, loss_fn)  # a warm-up step, not recorded
    comms.barrier()
    record: list = []
    pipeline.run_schedule(schedule, mine, x, y, loss_fn, record=record)
    return [(a.kind, start, end) for a, start, end in record]


def bubble(spans: list[list[tuple[str, float, float]]]) -> float:
    """The fraction of the step the ranks sat idle: 1 - busy time / (ranks x step time)."""
    start = min(s for rank in spans for _, s, _ in rank)
    end = max(e for rank in spans for _, _, e in rank)
    busy = sum(e - s for rank in spans for _, s, e in rank)
    return 1 - busy / (len(spans) * (end - start))


def draw(spans: list[list[tuple[str, float, float]]], width: int = 60) -> str:
    """Each rank's busy intervals as a text timeline: the action's letter where it works."""
    start = min(s for rank in spans for _, s, _ in rank)
    scale = width / (max(e for rank in spans for _, _, e in rank) - start)
    rows = []
    for r, rank in enumerate(spans):
        cells = ["."] * width
        for kind, s, e in rank:
            for t in range(int((s - start) * scale), max(int((e - start) * scale),
                                                           int((s - start) * scale) + 1)):
                cells[min(t, width - 1)] = kind
        rows.append(f"rank {r} |{''.join(cells)}|")
    return "\n".join(rows)
