"""Chapter 8, step 4: hybrid data x pipeline parallelism. dp replicas of a pp-stage pipeline on
dp x pp ranks: each replica pipelines its share of the batch with 1F1B, and each stage averages
its gradients with its replicas (microddp's DDP over the stage's data-parallel group) once per
step, however many micro-batches ran. Then the largest difference from one process.

    python course/08_pipeline/hybrid.py                 # 2 replicas x 2 stages = 4 ranks
    python course/08_pipeline/hybrid.py --dp 3 --pp 2 --microbatches 3
"""

import argparse

import torch
from problem import BATCH, DEPTH, LR, batch, fresh_model, loss_fn, one_process

import microddp as mdp
from microddp import pipeline
from microddp.comms.mesh import Mesh
from microddp.dp.comm_hooks import allreduce

STEPS = 3


def hybrid(world: mdp.World, dp: int, pp: int, m: int):
    mesh = Mesh(dp=dp, pp=pp)
    me = mesh.groups(world.rank)  # this rank's replica, stage, and its two sub-groups
    schedule = pipeline.build("1f1b", pp, m)
    model = fresh_model()
    cut = pipeline.split_model(model, pp)
    stages = pipeline.Replicated({me.stage: cut[me.stage]}, me.dp_group, dp)
    averaged = []  # one entry per bucket all-reduce: how often the replicas talk
    for ddp in stages.ddp.values():
        ddp.register_comm_hook(me.dp_group, lambda group, bucket: (averaged.append(1),
                                                                   allreduce(group, bucket))[1])
    opt = torch.optim.SGD(cut[me.stage].parameters(), lr=LR)
    for step in range(STEPS):
        x, y = batch(BATCH, step)
        # equal shares, so the mean of the replicas' mean losses is the batch's mean loss
        x, y = x.tensor_split(dp)[me.replica], y.tensor_split(dp)[me.replica]
        opt.zero_grad()
        with stages.no_sync():  # m micro-batches' gradients only add up
            pipeline.run_schedule(schedule, stages.modules, x, y, loss_fn, group=me.pp_group)
        stages.average()  # then the replicas average them, once
        opt.step()
    names = pipeline.stage_parameter_names(model, pp, me.stage)
    params = dict(model.named_parameters())
    return (me.replica, me.stage), {n: params[n].detach() for n in names}, len(averaged)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, default=2, help="replicas of the pipeline")
    p.add_argument("--pp", type=int, default=2, help="stages of the pipeline")
    p.add_argument("-m", "--microbatches", type=int, default=4)
    args = p.parse_args()
    share = BATCH // max(args.dp, 1)
    if not 1 <= args.pp <= DEPTH or args.dp < 1 or BATCH % args.dp or args.dp * args.pp > 8:
        p.error(f"use 1 to {DEPTH} stages, a number of replicas that divides {BATCH}, and "
                "at most 8 ranks in all")
    if not 1 <= args.microbatches <= share:
        p.error(f"use 1 to {share} micro-batches (each replica's share of the batch)")
    reference = one_process(STEPS, BATCH)
    ranks = mdp.spawn(hybrid, args.dp * args.pp, args=(args.dp, args.pp, args.microbatches),
                      backend="gloo")
    print(f"{args.dp} replicas x {args.pp} stages = {args.dp * args.pp} ranks, "
          f"{args.microbatches} micro-batches of each replica's {share} samples, "
          f"{STEPS} SGD steps")
    print(f"{'rank':>4}  replica  stage  all-reduces in {STEPS} steps  max |param - one process|")
    for r, ((replica, stage), params, averaged) in enumerate(ranks):
        diff = max((params[n] - reference[n]).abs().max().item() for n in params)
        print(f"{r:>4}  {replica:>7}  {stage:>5}  {averaged:>24}  {diff:>25.1e}")
    got = {n for _, params, _ in ranks for n in params}
    worst = max((t - reference[n]).abs().max().item() for _, ps, _ in ranks for n, t in ps.items())
    print(f"every layer trained: {got == set(reference)}; within 1e-6 of one process: "
          f"{worst <= 1e-6}")
