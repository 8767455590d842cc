"""Behaviours torch.distributed.pipelining's own multi-process schedule tests check, re-expressed
for microddp's torch-shaped classes on 2 gloo ranks, each against one process running a copy
of the same model (no code of theirs): stages are plain modules of the user's (square Linear
layers, not a FullMLP cut by microddp), the loss is MSELoss(reduction="sum") with
scale_grads=False, and the comparisons are the merged output, the sum of the micro-batch
losses, and every gradient, with torch's tests' tolerances (rtol 1e-5, atol 4e-5):

- a forward-only schedule chained over several iterations (output fed back as the next input);
- GPipe and 1F1B with shapes inferred and with input_args/output_args given;
- interleaved 1F1B and interleaved zero bubble with 2 stages per rank and 8 micro-batches;
- ZB-V (stages in a V: rank 0 holds the first and the last) with 1 micro-batch;
- several steps without zeroing the gradients (they accumulate as one process's do);
- keyword arguments given to the first stage's step;
- no tensor left in a reference cycle by a step (what their leak check looks for).
"""

import copy
import gc

import torch
from torch import nn

import microddp as mdp
from microddp import comms, pipeline
from microddp.pipeline.schedules import place

D, BATCH = 16, 32
TOL = {"rtol": 1e-5, "atol": 4e-5}


class Layers(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.ReLU()) for _ in range(n))

    def forward(self, x, bias=None):
        if bias is not None:
            x = x + bias
        for layer in self.layers:
            x = layer(x)
        return x


class WithBias(nn.Module):
    """The first stage: takes the model's keyword argument."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, bias=None):
        return self.layer(x if bias is None else x + bias)


def setup(n_stages: int):
    torch.manual_seed(0)
    full = Layers(n_stages)
    x = torch.randn(BATCH, D)
    with torch.no_grad():
        target = full(x) + torch.randn(BATCH, D)
    return full, copy.deepcopy(full), x, target


def grads_of(modules):
    return [q.grad.clone() for mod in modules for q in mod.parameters()]


def run(world, cls: str, v: int, m: int, steps: int, static=False, zero=True, bias=False):
    """`steps` steps of `cls` on this rank's stages and the same on one process; returns what
    must match: (ours, reference) pairs of outputs, summed losses and gradients."""
    p, rank = world.world_size, world.rank
    full, ref, x, target = setup(p * v)
    loss_fn = nn.MSELoss(reduction="sum")
    shape = "v" if cls == "ScheduleZBVZeroBubble" else "loop"
    mine = [s for s in range(p * v) if place(s, p, shape) == rank]
    last = place(p * v - 1, p, shape)
    modules = [full.layers[s] for s in mine]
    if bias and rank == 0:
        modules[0] = WithBias(modules[0])
    kw = {"bias": torch.full((BATCH, D), 0.5)} if bias else {}
    stages = []
    for s, mod in zip(mine, modules, strict=True):
        extra = {}
        if static:  # the example micro-batch torch's static mode takes
            inp = torch.zeros(BATCH // m, D)
            extra = {"input_args": (inp,), "output_args": mod(inp)}
        stages.append(pipeline.PipelineStage(mod, s, p * v, torch.device("cpu"), **extra))
    schedule = getattr(pipeline, cls)(stages[0] if v == 1 else stages, m, loss_fn=loss_fn,
                                      scale_grads=False)
    for _ in range(steps):
        if zero:
            for mod in modules:
                mod.zero_grad()
            ref.zero_grad()
        ref_out = ref(x, **kw)
        ref_loss = loss_fn(ref_out, target)
        ref_loss.backward()
        losses: list = []
        out = schedule.step(*([x] if rank == 0 else []), target=target if rank == last else None,
                            losses=losses if rank == last else None, **(kw if rank == 0 else {}))
    ref_grads = grads_of([ref.layers[s] for s in mine])
    got = {"grads": (grads_of(modules), ref_grads)}
    if rank == last:
        got["out"] = (out.detach(), ref_out.detach())
        got["loss"] = (sum(t.item() for t in losses), ref_loss.item())
    return got


def forward_chain(world, iterations: int = 4):
    """A schedule without loss_fn, its output fed back in: the model applied `iterations`
    times, on the last rank (which sends its output back to rank 0 each time)."""
    p, rank = world.world_size, world.rank
    full, ref, x, _ = setup(p)
    stage = pipeline.PipelineStage(full.layers[rank], rank, p, torch.device("cpu"))
    schedule = pipeline.ScheduleGPipe(stage, 4)
    expected = x.clone()
    with torch.no_grad():
        for _ in range(iterations):
            expected = ref(expected)
    for _ in range(iterations):
        if rank == 0:
            schedule.step(x)
            comms.recv(x, src=p - 1)
        else:
            out = schedule.step()
            comms.send(out.detach().contiguous(), dst=0)
    return (out.detach(), expected) if rank == p - 1 else None


def no_tensor_in_a_cycle(world):
    p, rank = world.world_size, world.rank
    full, _, x, target = setup(2 * p)
    stages = [pipeline.PipelineStage(full.layers[s], s, 2 * p, torch.device("cpu"))
              for s in range(rank, 2 * p, p)]
    schedule = pipeline.ScheduleInterleavedZeroBubble(stages, 4, loss_fn=nn.MSELoss())
    schedule.step(*([x] if rank == 0 else []), target=target if rank == p - 1 else None)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(2):
            schedule.step(*([x] if rank == 0 else []), target=target if rank == p - 1 else None)
        gc.collect()
        return sum(isinstance(o, torch.Tensor) for o in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


CASES = {
    "gpipe inferred": ("ScheduleGPipe", 1, 4, 2),
    "gpipe static": ("ScheduleGPipe", 1, 4, 2, True),
    "1f1b inferred": ("Schedule1F1B", 1, 4, 2),
    "1f1b static": ("Schedule1F1B", 1, 4, 2, True),
    "interleaved": ("ScheduleInterleaved1F1B", 2, 8, 2),
    "zero bubble": ("ScheduleInterleavedZeroBubble", 2, 8, 2),
    "zero bubble accumulating": ("ScheduleInterleavedZeroBubble", 2, 8, 4, False, False),
    "1f1b kwargs": ("Schedule1F1B", 1, 4, 2, False, True, True),
    "zbv one micro-batch": ("ScheduleZBVZeroBubble", 2, 1, 2),
}


def everything(world):
    return ({name: run(world, *case) for name, case in CASES.items()}, forward_chain(world),
            no_tensor_in_a_cycle(world))


def test_torchs_schedule_behaviours_on_two_ranks():
    ranks = mdp.spawn(everything, 2, backend="gloo", timeout=300)
    for rank, (cases, chain, leaked) in enumerate(ranks):
        for name, got in cases.items():
            last = rank == place(2 * CASES[name][1] - 1, 2, "v" if "zbv" in name else "loop")
            assert set(got) == ({"grads", "out", "loss"} if last else {"grads"}), name
            ours, ref = got["grads"]
            assert len(ours) == len(ref) > 0
            for a, b in zip(ours, ref, strict=True):
                torch.testing.assert_close(a, b, **TOL, msg=f"{name} rank {rank}")
            if last:
                torch.testing.assert_close(*got["out"], **TOL, msg=name)
                assert abs(got["loss"][0] - got["loss"][1]) <= 1e-5 * abs(got["loss"][1]), name
        if rank == 1:
            torch.testing.assert_close(*chain, **TOL)
        assert leaked == 0, f"rank {rank}: {leaked} tensors in reference cycles"
