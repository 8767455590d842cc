"""Chapter 13: predict's step time for a mesh against the step time measured on this host.

    python course/13_3d_parallel/predict_vs_measured.py
    python course/13_3d_parallel/predict_vs_measured.py --meshes 1x1x2 1x2x2 --steps 12

The host is calibrated first, in the same run: one process trains the same GPT (its step time
gives the FLOP/s the predictor assumes) and two ranks time an all-reduce of 4 KiB and 1 MiB
(its latency alpha and bandwidth 1/beta). Then each mesh trains `--steps` steps with
`microddp train --model gpt --tp T --pp P`; the median step after the first two is set beside
`microddp predict`'s step for that mesh. Ranks beyond the host's cores share them, and other
programs running on the host share them too: the ratio says how far the model is, here, now.
"""

import argparse
import os
import statistics
import tempfile
import time

import torch

import microddp as mdp
from microddp.predict import mesh3d
from microddp.predict.step import Hardware
from microddp.train import loop
from microddp.train.config import TrainConfig

JOB = {"model": "gpt", "hidden": 128, "depth": 4, "heads": 4, "plot": False, "batch_size": 32,
       "lr": 0.01, "log_every": 1000}
SEQ, VOCAB = 32, 256  # the job's text windows and bytes


def worker(world, out, kw):
    marks = []
    cfg = TrainConfig(**{**JOB, "out": out, **kw})
    loop.train(world, cfg, on_step=lambda step: marks.append(time.perf_counter()))
    return [b - a for a, b in zip(marks, marks[1:], strict=False)]


def step_time(n, steps, **kw):
    out = tempfile.mkdtemp(prefix="mesh-")  # one run folder for all the ranks
    gaps = mdp.spawn(worker, n, args=(out, {"max_steps": steps, **kw}), timeout=900, backend="gloo")[0]
    return statistics.median(gaps[2:] if len(gaps) > 4 else gaps)


def ping(world, sizes, rounds):
    out = []
    for n in sizes:
        t = torch.ones(n // 4)
        for _ in range(3):
            mdp.comms.all_reduce(t)
        start = time.perf_counter()
        for _ in range(rounds):
            mdp.comms.all_reduce(t)
        out.append((time.perf_counter() - start) / rounds)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--meshes", nargs="+", default=["1x1x2", "1x2x1", "1x2x2", "2x1x2", "2x2x1"],
                   help="dp x pp x tp")
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    shape = mesh3d.GPTShape(JOB["hidden"], JOB["depth"], JOB["heads"], SEQ, VOCAB,
                            JOB["batch_size"])
    one = step_time(1, args.steps)
    flops = mesh3d.predict_mesh(shape, 1, 1, 1, Hardware(1.0, 1e30, 0.0))["step_s"]
    small, big = 4 << 10, 1 << 20
    t_small, t_big = mdp.spawn(ping, 2, args=((small, big), 20), timeout=300, backend="gloo")[0]
    hw = Hardware(flops / one, (big - small) / max(t_big - t_small, 1e-9), t_small / 2,
                  "this host, measured now", cores=os.cpu_count() or 1)
    print(f"calibration: one process {1e3 * one:.1f} ms a step = {hw.flops:.3g} FLOP/s; "
          f"all-reduce alpha {1e6 * hw.latency:.0f} us, bandwidth {hw.bandwidth:.3g} B/s; "
          f"{hw.cores} cores")
    print(f"{'dp x pp x tp':>12}  {'predicted ms':>12}  {'measured ms':>11}  {'ratio':>5}")
    for mesh in args.meshes:
        dp, pp, tp = (int(v) for v in mesh.split("x"))
        n = dp * pp * tp
        measured = step_time(n, args.steps, tp=tp, pp=pp)
        row = mesh3d.predict_mesh(shape, dp, pp, tp, hw, microbatches=pp, per_host=n)
        print(f"{mesh:>12}  {1e3 * row['step_s']:12.1f}  {1e3 * measured:11.1f}  "
              f"{row['step_s'] / measured:5.2f}")
    print("ratio = predicted / measured step time")


if __name__ == "__main__":
    main()
