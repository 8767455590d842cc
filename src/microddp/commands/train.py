"""Train an MLP on real data with data parallelism: the job to run first.

Starts --nproc local ranks (or runs as one worker under torchrun / `microddp run`), trains
FullMLP on scikit-learn's handwritten digits with the chosen data-parallel engine, prints
progress and per-epoch test accuracy on rank 0, and leaves a run folder with metrics.jsonl,
model.pt (the bare module's state_dict), curves.png and checkpoints to resume from.
"""

from __future__ import annotations

import argparse
import os

from ..train import start, worker
from ..train.config import add_arguments, from_args

EPILOG = """\
examples:
  microddp train                                  # 2 CPU ranks, digits, >90% in seconds
  microddp train --nproc 4 --epochs 5 --engine torch
  microddp train --batch-size 32 --accumulate 4 --amp bf16 --epochs 2
  microddp train --out runs/a --epochs 2 --checkpoint-every 10 --max-restarts 2
  microddp train --out runs/a --resume --epochs 4   # continue run a for longer

one host, under torchrun instead of the built-in launcher:
  torchrun --nproc-per-node 4 --max-restarts 2 -m microddp.train --out runs/b
many hosts (the run folder on a shared file system), on each host (NODE_RANK 0, 1, ...;
HOST0 host 0's address; docs/many-hosts.md has c10d and SLURM):
  torchrun --nnodes 2 --nproc-per-node 4 --node-rank $NODE_RANK \\
           --master-addr $HOST0 --master-port 29400 -m microddp.train --out /shared/runs/c
"""

__all__ = ["EPILOG", "add_arguments", "run"]


def run(args: argparse.Namespace) -> int:
    """`microddp train`: a worker under a launcher (RANK set), else start --nproc workers."""
    cfg = from_args(args)
    if "RANK" in os.environ:
        return worker(cfg)
    return start(cfg)
