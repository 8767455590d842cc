"""Chapter 8, step 3: every schedule trains exactly as one process does. The same model, seed
and batches; 3 SGD steps on p ranks with m micro-batches of a batch that m does not divide;
then the largest difference from one process's parameters.

    python course/08_pipeline/exact.py             # 2 ranks, 5 micro-batches of 23 samples
    python course/08_pipeline/exact.py -n 3 -m 2
"""

import argparse

import torch
from problem import DEPTH, LR, batch, fresh_model, loss_fn, one_process

import microddp as mdp
from microddp import pipeline

STEPS, SIZE = 3, 23


def pipelined(world: mdp.World, m: int) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's parameters after STEPS steps, for each schedule."""
    out = {}
    for name in pipeline.BUILDERS:
        schedule = pipeline.build(name, world.world_size, m)
        model = fresh_model()
        stages = pipeline.split_model(model, schedule.stages)
        mine = {s: stages[s] for s in schedule.stages_of(world.rank)}
        opt = torch.optim.SGD([q for s in mine.values() for q in s.parameters()], lr=LR)
        for step in range(STEPS):
            x, y = batch(SIZE, step)
            opt.zero_grad()
            pipeline.run_schedule(schedule, mine, x, y, loss_fn)
            opt.step()
        names = [n for s in mine for n in pipeline.stage_parameter_names(model, schedule.stages, s)]
        params = dict(model.named_parameters())
        out[name] = {n: params[n].detach() for n in names}
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--world-size", type=int, default=2, help="ranks (pipeline stages)")
    p.add_argument("-m", "--microbatches", type=int, default=5)
    args = p.parse_args()
    if not 1 <= 2 * args.world_size <= DEPTH or not 1 <= args.microbatches <= SIZE:
        p.error(f"use 1 to {DEPTH // 2} ranks (interleaving puts 2 stages on each) and 1 to "
                f"{SIZE} micro-batches")
    reference = one_process(STEPS, SIZE)
    ranks = mdp.spawn(pipelined, args.world_size, args=(args.microbatches,), backend="gloo")
    sizes = pipeline.microbatch_sizes(SIZE, args.microbatches)
    print(f"{args.world_size} ranks, micro-batches of {sizes} samples, {STEPS} SGD steps")
    print(f"{'schedule':12s} {'max |param - one process|':>26s}  every layer  within 1e-6")
    for name in pipeline.BUILDERS:
        got = {n: t for r in ranks for n, t in r[name].items()}
        diff = max((got[n] - reference[n]).abs().max().item() for n in reference)
        print(f"{name:12s} {diff:26.1e}  {sorted(got) == sorted(reference)!s:11s}  "
              f"{diff <= 1e-6}")
