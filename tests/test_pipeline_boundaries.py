"""Pipeline stage boundaries beyond one tensor, and steps that change or disagree.

- Several tensors per boundary (two float activations and an integer one) and a keyword
  argument to the first stage's rank: microddp's PipelineStage and schedules against torch's
  torch.distributed.pipelining with the same split, seed and batches on 2 ranks (losses,
  gradients, parameters, outputs).
- A batch whose size changes from step to step on 3 ranks (the middle rank never sees it):
  every step equals one process with torch's per-micro-batch mean.
- Bad input seen on one rank only (a target of another size, no batch, a width or dtype one
  rank built differently; issue 57's run_schedule with ranks differing in width, batch or
  dtype): the same MicroDDPError on every rank, and the ranks still in step afterwards.
"""

import re

import pytest
import torch
from torch import nn

import microddp as mdp
from microddp import MicroDDPError, pipeline
from pipeline_helpers import loss_fn

TOL = {"atol": 1e-6, "rtol": 1e-5}
DIM, LR, STEPS = 6, 0.1, 3


class Block(nn.Module):
    """A stage of a two-stream model: takes (h, g, ids) (or x on the first stage) and gives
    (h, g, ids), or the logits on the last stage. `scale`, a keyword input, multiplies h."""

    def __init__(self, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.h, self.g = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.emb = nn.Embedding(2, DIM)
        self.head = nn.Linear(DIM, 2) if last else None

    def forward(self, *args, scale=None):
        if self.first:
            (x,) = args
            h, g, ids = x, x.flip(1), (x[:, 0] > 0).long()
        else:
            h, g, ids = args
        if scale is not None:
            h = h * scale
        # clamped: torch's shape pass feeds a stage uninitialised integers
        h = torch.relu(self.h(h) + self.emb(ids.clamp(0, 1)))
        g = torch.tanh(self.g(g)) * h
        if self.last:
            return self.head(h + g)
        return h, g, ids


def blocks(n: int) -> list[Block]:
    torch.manual_seed(0)
    return [Block(s == 0, s == n - 1) for s in range(n)]


def batches(sizes):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(n, DIM, generator=g), torch.randint(0, 2, (n,), generator=g),
             torch.rand(n, 1, generator=g) + 0.5) for n in sizes]


def train(world, lib: str, name: str, v: int, m: int, sizes=(12, 12, 12)):
    """STEPS of SGD on this rank's stages of `Block`s with `lib`'s classes; returns per step
    (losses, output) on the last rank, and the grads of the last step and the parameters."""
    import torch.distributed.pipelining as theirs

    mod = theirs if lib == "torch" else pipeline
    p, rank = world.world_size, world.rank
    parts = blocks(p * v)
    mine = [s for s in range(p * v) if s % p == rank]
    stages = [mod.PipelineStage(parts[s], s, p * v, torch.device("cpu")) for s in mine]
    single = name in ("ScheduleGPipe", "Schedule1F1B")
    schedule = getattr(mod, name)(stages[0] if single else stages, m, loss_fn=loss_fn)
    params = [q for s in mine for q in parts[s].parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    first, last = rank == 0, rank == (p * v - 1) % p
    steps = []
    for x, y, scale in batches(sizes):
        opt.zero_grad()
        got: list = []
        out = schedule.step(*([x] if first else []), target=y if last else None,
                            losses=got if last else None, **({"scale": scale} if first else {}))
        steps.append(([t.item() for t in got], None if out is None else out.detach().clone()))
        grads = [q.grad.clone() for q in params]
        opt.step()
    return steps, grads, [q.detach().clone() for q in params]


CASES = [("ScheduleGPipe", 1, 4), ("Schedule1F1B", 1, 2), ("ScheduleInterleaved1F1B", 2, 2)]


def against_torch(world):
    return {case: (train(world, "microddp", *case), train(world, "torch", *case))
            for case in CASES}


def test_tuples_and_kwargs_cross_stages_as_in_torchs_pipelining():
    ranks = mdp.spawn(against_torch, 2, backend="gloo", timeout=240)
    for rank, r in enumerate(ranks):
        for case, ((s1, g1, p1), (s2, g2, p2)) in r.items():
            what = f"{case} rank {rank}"
            assert len(g1) == len(g2) > 0, what
            for (l1, o1), (l2, o2) in zip(s1, s2, strict=True):
                assert l1 == pytest.approx(l2, rel=1e-5, abs=1e-6), what
                assert (o1 is None) == (o2 is None) == (rank != 1), what
                if o1 is not None:
                    torch.testing.assert_close(o1, o2, **TOL, msg=what)
            for a, b in zip(g1, g2, strict=True):
                torch.testing.assert_close(a, b, **TOL, msg=f"{what} grad")
            for a, b in zip(p1, p2, strict=True):
                torch.testing.assert_close(a, b, **TOL, msg=f"{what} param")
            # the gradient reached every parameter, the second stream's too
            assert all(g.abs().sum() > 0 for g in g1), what


SIZES = (12, 8, 9, 12, 4)  # 9 in 4 micro-batches: 3, 2, 2, 2


def one_process(m: int):
    """What a pipeline of `Block`s must give for SIZES: per step, the losses and the last
    step's gradients, with torch's scale_grads (the mean of the micro-batches' mean losses)."""
    parts = blocks(3)
    params = [q for b in parts for q in b.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    steps = []
    for x, y, scale in batches(SIZES):
        opt.zero_grad()
        losses = []
        for a, b, c in zip(x.tensor_split(m), y.tensor_split(m), scale.tensor_split(m),
                           strict=True):
            out = parts[0](a, scale=c)
            out = parts[2](*parts[1](*out))
            losses.append(loss_fn(out, b))
        (sum(losses) / m).backward()
        steps.append([t.item() for t in losses])
        grads = [q.grad.clone() for q in params]
        opt.step()
    return steps, grads, [q.detach().clone() for q in params]


def changing_batches(world):
    return {name: train(world, "microddp", name, 1, 4, SIZES)
            for name in ("Schedule1F1B", "ScheduleGPipe", "ScheduleInterleavedZeroBubble")}


def test_a_batch_of_another_size_each_step_trains_as_one_process():
    ranks = mdp.spawn(changing_batches, 3, backend="gloo", timeout=240)
    ref_steps, ref_grads, ref_params = one_process(4)
    for name in ranks[0]:
        steps = ranks[2][name][0]
        assert [len(o) for _, o in steps] == list(SIZES), name
        for (got, _), want in zip(steps, ref_steps, strict=True):
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6), name
        grads = [g for r in ranks for g in r[name][1]]
        params = [q for r in ranks for q in r[name][2]]
        # rank r holds stage r: its parameters come in the one-process order
        for a, b in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(a, b, **TOL, msg=name)
        for a, b in zip(params, ref_params, strict=True):
            torch.testing.assert_close(a, b, **TOL, msg=name)


def refusals(world):
    """Each case breaks one rank only; returns {case: this rank's error}, then one good step
    (the ranks are still in step: nothing was left in flight)."""
    p, rank = world.world_size, world.rank
    x, y, _ = batches([12])[0]
    found = {}

    def attempt(case, fn):
        try:
            fn()
            found[case] = None
        except MicroDDPError as error:
            found[case] = str(error)

    def shaped(parts, feed_x=True, target=y):
        stage = pipeline.PipelineStage(parts[rank], rank, p, "cpu")
        schedule = pipeline.Schedule1F1B(stage, 4, loss_fn=loss_fn)
        return lambda: schedule.step(*([x] if rank == 0 and feed_x else []),
                                     target=target if rank == p - 1 else None)

    attempt("short target", shaped(blocks(p), target=y[:8]))
    attempt("no batch", shaped(blocks(p), feed_x=False))
    wide = pipeline.split_model(mdp.FullMLP(8, 3), p)
    if rank == 1:
        wide[1] = nn.Sequential(nn.Linear(16, 8), nn.ReLU())
    attempt("width (classes)", shaped(wide))
    # issue 57: run_schedule on ranks that built a different width or dtype, or pass
    # another batch
    schedule = pipeline.build("1f1b", p, 4)
    xs, ys = torch.randn(12, 8), torch.randint(0, 2, (12,))

    def run(model, a=xs, b=ys):
        parts = pipeline.split_model(model, p)
        return lambda: pipeline.run_schedule(schedule, {rank: parts[rank]}, a, b, loss_fn)

    torch.manual_seed(0)
    attempt("width", run(mdp.FullMLP(16 if rank == 1 else 8, 3)))
    torch.manual_seed(0)
    model = mdp.FullMLP(8, 3)
    attempt("dtype", run(model.double() if rank == 2 else model,
                         xs.double() if rank == 2 else xs))
    attempt("batch", run(mdp.FullMLP(8, 3), xs[:8] if rank == 1 else xs,
                         ys[:8] if rank == 1 else ys))
    torch.manual_seed(0)
    attempt("good step", run(mdp.FullMLP(8, 3)))
    return found


def test_one_ranks_bad_input_is_one_error_on_every_rank():
    ranks = mdp.spawn(refusals, 3, backend="gloo", timeout=120)
    want = {"short target": "target has 8 samples but the batch 12",
            "no batch": "passes the batch",
            "width (classes)": "shape pass",
            "width": "stage 0 \\(rank 0\\) gives width 8 float32 but stage 1 \\(rank 1\\) "
                     "takes width 16",
            "dtype": "stage 1 \\(rank 1\\) gives width 8 float32 but stage 2 \\(rank 2\\) "
                     "takes width 8 float64",
            "batch": "disagree on batch size"}
    for rank, found in enumerate(ranks):
        assert found.pop("good step") is None
        assert sorted(found) == sorted(want)
        for case, error in found.items():
            assert error is not None, (case, rank)
            # the rank at fault says what; the others name it and stop too
            assert re.search(want[case], error) or "refused this step" in error, (case, rank,
                                                                                 error)
    for case in ("width", "dtype", "batch", "short target"):
        assert all(re.search(want[case], r[case]) for r in ranks), case
