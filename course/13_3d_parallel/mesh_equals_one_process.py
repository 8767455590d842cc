"""Chapter 13: the GPT trained on a dp x pp x tp mesh lands on one process's parameters.

    python course/13_3d_parallel/mesh_equals_one_process.py                 # 2 x 2 x 2: 8 ranks
    python course/13_3d_parallel/mesh_equals_one_process.py --meshes 1x2x2 2x1x2 2x2x1

Each mesh is `microddp train --model gpt --tp T --pp P` on dp * pp * tp ranks (dp x pp x tp,
as written), the same seed and global batch as `--nproc 1`, four SGD steps; the script prints
the largest difference of any parameter from the one process's, and the same for model.pt.
"""

import argparse
import tempfile
from pathlib import Path

import torch

import microddp as mdp
from microddp.train import loop
from microddp.train.config import TrainConfig

JOB = {"model": "gpt", "hidden": 32, "heads": 4, "plot": False, "batch_size": 16, "lr": 0.1,
       "log_every": 100}


def worker(world, out, kw):
    return loop.train(world, TrainConfig(**{**JOB, "out": out, **kw})).params


def run(n, **kw):
    out = tempfile.mkdtemp(prefix="mesh-")
    params = mdp.spawn(worker, n, args=(out, kw), timeout=600, backend="gloo")[0]
    return params, torch.load(Path(out) / "model.pt", weights_only=True)


def worst(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in b)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--meshes", nargs="+", default=["2x2x2"], help="dp x pp x tp, e.g. 1x2x2")
    p.add_argument("--depth", type=int, default=2, help="GPT blocks (at least the largest pp)")
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    common = {"depth": args.depth, "max_steps": args.steps}
    reference, _ = run(1, **common)
    print(f"one process: {args.steps} SGD steps, {sum(v.numel() for v in reference.values())} "
          "parameters")
    for mesh in args.meshes:
        dp, pp, tp = (int(v) for v in mesh.split("x"))
        params, saved = run(dp * pp * tp, tp=tp, pp=pp, **common)
        print(f"dp {dp} x pp {pp} x tp {tp} ({dp * pp * tp} ranks): max |param diff| "
              f"{worst(params, reference):.1e}, model.pt {worst(saved, reference):.1e}")


if __name__ == "__main__":
    main()
