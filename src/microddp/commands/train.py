"""Train an MLP on real data: the job to run first.

Starts --nproc local ranks (or runs as one worker under torchrun / `microddp run`), trains
FullMLP on scikit-learn's handwritten digits with the chosen strategy (data parallel by
default; pipeline, hybrid or ZeRO with --strategy; with --strategy async, a parameter server and
its workers under a staleness bound), prints progress and per-epoch test accuracy on rank 0,
and leaves a run folder with metrics.jsonl, model.pt (the whole model's state_dict),
curves.png and checkpoints to resume from.
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

strategies (--batch-size stays the global batch; the same seed trains to the same weights):
  microddp train --strategy zero2 --optimizer adam --epochs 2    # sharded grads + Adam state
  microddp train --strategy zero3 --nproc 4 --accumulate 2 --amp bf16 --epochs 3
  microddp train --strategy pp --nproc 2 --schedule gpipe --microbatches 4 --epochs 1
  microddp train --strategy dp-pp --nproc 4 --pp 2 --schedule zero-bubble --depth 4 --optimizer adam --epochs 1

asynchronous, with a parameter server (rank 0) and --nproc - 1 workers:
  microddp train --strategy async --nproc 3 --staleness inf --straggler 2:4 --epochs 2
  microddp train --strategy async --nproc 4 --backup-workers 1 --straggler 3:4 --epochs 2
  a worker that dies is dropped (the run goes on and records it); if the server dies, the
  workers stop, and --max-restarts K restarts everyone from the server's checkpoint

one host, under torchrun instead of the built-in launcher:
  torchrun --nproc-per-node 4 --max-restarts 2 -m microddp.train --out runs/b
many hosts (the run folder on a shared file system), on each host (NODE_RANK 0, 1, ...;
HOST0 host 0's address; docs/11-many-hosts.md has c10d and SLURM):
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
