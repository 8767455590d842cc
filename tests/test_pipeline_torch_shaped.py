"""microddp.pipeline's torch-shaped classes (PipelineStage, ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble) against
torch.distributed.pipelining's own, in the same job on 2 and 3 ranks: the same split, seed and batches, 3 SGD steps, each
rank calling `step` as torch's contract says (batch on the first stage, target on the last).
Compared: every micro-batch's loss, the last step's gradients, the parameters after the
steps, the merged output, and a forward-only `eval` (output and losses); with a mean loss
(torch's default scale_grads) and a sum loss (scale_grads=False). Then with 1 and 2
micro-batches, fewer than the stages (which torch's Schedule1F1B refuses), against one process
on the whole batch.

Batch 12, so that the micro-batches are equal and a mean of micro-batch means is the batch's
mean: the one-process reference and torch's scale_grads agree only then.
"""

import pytest
import torch
from torch import nn

import microddp as mdp
from microddp import pipeline
from microddp.pipeline.schedules import place
from pipeline_helpers import LR, data, fresh_model, loss_fn

BATCH = 12
TOL = {"atol": 1e-6, "rtol": 1e-5}
NAMES = ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
         "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble")
VIRTUAL = {"ScheduleGPipe": 1, "Schedule1F1B": 1}


def placement(name: str) -> str:
    return "v" if name == "ScheduleZBVZeroBubble" else "loop"


def last_rank(name: str, p: int) -> int:
    return place(VIRTUAL.get(name, 2) * p - 1, p, placement(name))


def sum_loss(out, y):
    return nn.functional.cross_entropy(out, y, reduction="sum")


def train(world, lib, name: str, m: int, loss="mean"):
    """STEPS steps of SGD with `lib`'s (torch's or microddp's) classes on this rank's stages:
    (losses per step, grads of the last step, params after, merged outputs, eval output and
    eval losses) for this rank's parameters (the outputs and losses on the last rank only)."""
    import torch.distributed.pipelining as theirs

    mod = theirs if lib == "torch" else pipeline
    p, rank = world.world_size, world.rank
    v = VIRTUAL.get(name, 2)
    model, (xs, ys) = fresh_model(), data(BATCH)
    parts = pipeline.split_model(model, p * v)
    mine = [s for s in range(p * v) if place(s, p, placement(name)) == rank]
    names = [n for s in mine for n in pipeline.stage_parameter_names(model, p * v, s)]
    stages = [mod.PipelineStage(parts[s], s, p * v, torch.device("cpu")) for s in mine]
    fn = loss_fn if loss == "mean" else sum_loss
    cls = getattr(mod, name)
    arg = stages[0] if v == 1 else stages
    schedule = cls(arg, m, loss_fn=fn, scale_grads=(loss == "mean"))
    opt = torch.optim.SGD([q for s in mine for q in parts[s].parameters()], lr=LR)
    named, losses, outs = dict(model.named_parameters()), [], []
    first, last = rank == 0, rank == last_rank(name, p)
    for x, y in zip(xs, ys, strict=True):
        opt.zero_grad()
        got: list = []
        out = schedule.step(*([x] if first else []), target=y if last else None,
                            losses=got if last else None)
        losses.append([t.item() for t in got])
        outs.append(None if out is None else out.detach().clone())
        grads = {n: named[n].grad.clone() for n in names}
        opt.step()
    if lib == "torch" and name == "ScheduleZBVZeroBubble":
        # torch 2.13's ZB-V fails in eval ("can't steal_bwd_input if this stage doesn't have
        # backward"); microddp's is checked against one process in the test below
        return (losses, grads, {n: named[n].detach().clone() for n in names}, outs, None)
    got = []
    out = schedule.eval(*([xs[0]] if first else []), target=ys[0] if last else None,
                        losses=got if last else None)
    evaluated = (None if out is None else out.detach().clone(), [t.item() for t in got])
    return (losses, grads, {n: named[n].detach().clone() for n in names}, outs, evaluated)


def cases(p: int) -> list[tuple[str, int, str]]:
    m_int = 4 if p == 2 else 3  # m = p works for every torch schedule (its interleaved needs
    # m a multiple of max(1, m // p) rounds)
    return ([(n, m, "mean") for n in NAMES for m in sorted({p, 2 * p})] +
            [("Schedule1F1B", m_int, "sum"), ("ScheduleInterleavedZeroBubble", m_int, "sum"),
             ("ScheduleZBVZeroBubble", m_int, "sum")])


def against_torch(world):
    return {case: (train(world, "microddp", *case), train(world, "torch", *case))
            for case in cases(world.world_size)}


@pytest.mark.parametrize("p", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_torch_shaped_schedules_equal_torchs(p):
    ranks = mdp.spawn(against_torch, p, backend="gloo", timeout=300)
    assert len(ranks[0]) == len(cases(p))
    for rank, r in enumerate(ranks):
        for case, (ours, theirs) in r.items():
            what = f"{case} rank {rank}"
            (l1, g1, p1, o1, e1), (l2, g2, p2, o2, e2) = ours, theirs
            assert len(l1) == len(l2) == 3
            for a, b in zip(l1, l2, strict=True):
                assert a == pytest.approx(b, rel=1e-5, abs=1e-6), what
            assert g1.keys() == g2.keys() and g1, what
            for n in g1:
                torch.testing.assert_close(g1[n], g2[n], **TOL, msg=f"{what} grad {n}")
                torch.testing.assert_close(p1[n], p2[n], **TOL, msg=f"{what} {n}")
            for a, b in zip(o1, o2, strict=True):
                assert (a is None) == (b is None), what
                if a is not None:
                    torch.testing.assert_close(a, b, **TOL, msg=f"{what} output")
            if e2 is None:  # torch could not evaluate
                continue
            assert (e1[0] is None) == (e2[0] is None), what
            if e1[0] is not None:
                torch.testing.assert_close(e1[0], e2[0], **TOL, msg=f"{what} eval output")
                assert e1[1] == pytest.approx(e2[1], rel=1e-5, abs=1e-6), what
        for case in r:
            got = r[case][0][0]
            want = case[1] if rank == last_rank(case[0], p) else 0
            assert all(len(s) == want for s in got), (case, rank)


def fewer_than_stages(world):
    """m < stages: every class with m = 1 and 2 on this world."""
    return {(name, m): train(world, "microddp", name, m) for name in NAMES for m in (1, 2)}


def test_fewer_microbatches_than_stages_equal_one_process():
    p = 3
    ranks = mdp.spawn(fewer_than_stages, p, backend="gloo", timeout=300)
    model, (xs, ys) = fresh_model(), data(BATCH)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_losses = []
    for x, y in zip(xs, ys, strict=True):
        opt.zero_grad()
        out = model(x)
        loss = loss_fn(out, y)
        loss.backward()
        ref_losses.append(loss.item())
        grads = {n: q.grad.clone() for n, q in model.named_parameters()}
        opt.step()
    with torch.no_grad():
        ref_eval = model(xs[0])
    params = dict(model.named_parameters())
    for case in ranks[0]:
        last = ranks[last_rank(case[0], p)][case]
        got_grads = {n: t for r in ranks for n, t in r[case][1].items()}
        got_params = {n: t for r in ranks for n, t in r[case][2].items()}
        assert sorted(got_params) == sorted(params), case
        for n in params:
            torch.testing.assert_close(got_grads[n], grads[n], **TOL, msg=f"{case} grad {n}")
            torch.testing.assert_close(got_params[n], params[n].detach(), **TOL,
                                       msg=f"{case} {n}")
        # the mean of the m micro-batch losses is the batch's (equal micro-batches)
        for step, ref in zip(last[0], ref_losses, strict=True):
            assert len(step) == case[1] and sum(step) / case[1] == pytest.approx(ref, rel=1e-5)
        torch.testing.assert_close(last[4][0], ref_eval, **TOL, msg=f"{case} eval")
