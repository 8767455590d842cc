"""microddp's GPipe and 1F1B against torch.distributed.pipelining's (PipelineStage with
ScheduleGPipe / Schedule1F1B) on gloo, for the same split, the same micro-batches and 3 SGD
steps: the same gradients and parameters.

The batch is 12 so that every micro-batch has the same size: torch averages the micro-batches'
mean losses (scale_grads), which is the batch's mean only for equal micro-batches, where
microddp weighs each micro-batch by its size and so stays exact for uneven ones too. torch's
1F1B refuses fewer micro-batches than stages, so m < p runs with GPipe only.
"""

import pytest
import torch
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from microddp import pipeline
from microddp.bench.pipeline import torch_schedule_step
from pipeline_helpers import LR, data, fresh_model, loss_fn, pipelined

BATCH = 12
CASES = [("gpipe", 1), ("gpipe", 2), ("gpipe", 3), ("gpipe", 4), ("1f1b", 2), ("1f1b", 3),
         ("1f1b", 4)]
TORCH = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def torchs(world, name: str, m: int):
    p, rank = world.world_size, world.rank
    model, (xs, ys) = fresh_model(), data(BATCH)
    module = pipeline.split_model(model, p)[rank]
    names = pipeline.stage_parameter_names(model, p, rank)
    stage = PipelineStage(module, rank, p, torch.device("cpu"))
    schedule = TORCH[name](stage, m, loss_fn=loss_fn)
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    named = dict(model.named_parameters())
    for x, y in zip(xs, ys, strict=True):
        opt.zero_grad()
        torch_schedule_step(schedule, rank, p, x, y)
        grads = {n: named[n].grad.clone() for n in names}
        opt.step()
    return {n: named[n].detach().clone() for n in names}, grads


def both(world):
    return {case: (pipelined(world, *case, batch=BATCH)[:2], torchs(world, *case))
            for case in CASES if case[0] == "gpipe" or case[1] >= world.world_size}


@pytest.mark.parametrize("p", [2, 3])
def test_gpipe_and_1f1b_equal_torchs_pipelining(p):
    import microddp as mdp

    ranks = mdp.spawn(both, p, backend="gloo", timeout=240)
    assert len(ranks[0]) == (7 if p == 2 else 6)
    for r in ranks:
        for case, ((ours_p, ours_g), (theirs_p, theirs_g)) in r.items():
            for n in ours_p:
                torch.testing.assert_close(ours_g[n], theirs_g[n], atol=1e-6, rtol=1e-5,
                                           msg=f"{case} grad {n}")
                torch.testing.assert_close(ours_p[n], theirs_p[n], atol=1e-6, rtol=1e-5,
                                           msg=f"{case} {n}")
