"""Train an MLP on real data with data parallelism: the job to run first.

Starts --nproc local ranks (or runs as one worker under torchrun / `microddp run`), trains
FullMLP on scikit-learn's handwritten digits with the chosen data-parallel engine, prints
progress and per-epoch test accuracy on rank 0, and leaves a run folder with metrics.jsonl,
model.pt (the bare module's state_dict), curves.png and checkpoints to resume from.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .. import outputs
from ..errors import MicroDDPError
from .config import AMP, ENGINES, OPTIMIZERS, TrainConfig, check_folder, from_args, validate

__all__ = ["TrainConfig", "add_arguments", "run", "train", "worker"]

EPILOG = """\
examples:
  microddp train                                  # 2 CPU ranks, digits, >90% in seconds
  microddp train --nproc 4 --epochs 5 --engine torch
  microddp train --batch-size 32 --accumulate 4 --amp bf16 --epochs 2
  microddp train --out runs/a --epochs 2 --checkpoint-every 10 --max-restarts 2
  microddp train --out runs/a --resume --epochs 4   # continue run a for longer

one host, under torchrun instead of the built-in launcher:
  torchrun --nproc-per-node 4 --max-restarts 2 -m microddp.train --out runs/b
many hosts (the run folder must be on a shared file system), on each host:
  torchrun --nnodes 2 --nproc-per-node 4 --node-rank R --rdzv-backend c10d \\
           --rdzv-endpoint HOST0:29400 -m microddp.train --out /shared/runs/c
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    a = p.add_argument
    a("-n", "--nproc", type=int, default=d.nproc, help=f"local ranks to start (default {d.nproc})")
    a("--epochs", type=int, default=d.epochs, help=f"passes over the data (default {d.epochs})")
    a("--batch-size", type=int, default=d.batch_size,
      help=f"global batch per micro-step, split over ranks (default {d.batch_size})")
    a("--lr", type=float, default=None, help="learning rate (default 0.05 sgd, 0.002 adam)")
    a("--optimizer", default=d.optimizer,
      help=f"{' | '.join(OPTIMIZERS)} (default {d.optimizer})")
    a("--engine", default=d.engine,
      help=f"data-parallel engine: {' | '.join(ENGINES)} (torch = PyTorch's DDP; "
           f"default {d.engine})")
    a("--dataset", default=d.dataset,
      help=f"digits (real, bundled) | synthetic (default {d.dataset})")
    a("--accumulate", type=int, default=d.accumulate,
      help=f"micro-steps per optimizer step, with no_sync (default {d.accumulate})")
    a("--amp", default=None,
      help=f"mixed precision: {' | '.join(AMP)} (fp16 needs CUDA; default: off, float32)")
    a("--hidden", type=int, default=d.hidden, help=f"MLP width (default {d.hidden})")
    a("--depth", type=int, default=d.depth, help=f"hidden layers (default {d.depth})")
    a("--out", default=None, help="run folder (default: a new runs/train-DATE-TIME)")
    a("--checkpoint-dir", default=None, help="checkpoint folder (default OUT/checkpoints)")
    a("--checkpoint-every", type=int, default=d.checkpoint_every,
      help="save every N optimizer steps (default 0: after every epoch)")
    a("--keep", type=int, default=d.keep, help=f"checkpoints to keep (default {d.keep})")
    a("--resume", action="store_true", help="continue from the newest checkpoint in the folder")
    a("--max-restarts", type=int, default=d.max_restarts,
      help="restart all ranks up to K times if one dies; they resume from the last checkpoint "
           f"(default {d.max_restarts})")
    a("--max-steps", type=int, default=d.max_steps,
      help="stop after N optimizer steps (default 0: all)")
    a("--seed", type=int, default=d.seed,
      help=f"seed of the weights and the shuffling (default {d.seed})")
    a("--log-every", type=int, default=d.log_every,
      help="steps between progress lines (default 0: about five per epoch)")
    a("--trace", action="store_true", help="record a timeline of every step (Chrome trace and summary)")
    a("--monitor-timeout", type=float, default=d.monitor_timeout,
      help="seconds a collective may stall before every rank reports where it is "
           f"(default {d.monitor_timeout:g}; 0 turns the hang monitor off)")
    a("--drift-every", type=int, default=d.drift_every,
      help="every K steps check that all replicas hold the same parameters (default 0: off)")
    a("--no-plot", dest="plot", action="store_false", help="skip curves.png")


def default_out() -> str:
    """A new, empty run folder of this job's own (see microddp.outputs)."""
    return str(outputs.new_run_dir("train"))


def _check_checkpoints(cfg: TrainConfig) -> None:
    """Fail before starting any rank if --resume has nothing (readable) to resume, the settings
    differ from the checkpoint's, or a new run would mix its checkpoints with an old run's."""
    from .resume import decide

    _, error = decide(cfg)
    if error:
        raise MicroDDPError(error)


def run(args: argparse.Namespace) -> int:
    """`microddp train`: a worker under a launcher (RANK set), else start --nproc workers."""
    cfg = from_args(args)
    if "RANK" in os.environ:
        return worker(cfg)
    validate(cfg)
    if cfg.resume:
        for flag, value in (("--out", cfg.out), ("--checkpoint-dir", cfg.checkpoint_dir)):
            if value and not Path(value).is_dir():
                raise MicroDDPError(f"--resume: {flag} {value} does not exist; "
                                    "give the folder of the run to continue")
    folder, created = outputs.claim(cfg.out, "train")
    cfg.out = str(folder)
    code, announced = 1, False
    try:
        check_folder(cfg.out, "--out")
        if cfg.checkpoint_dir:
            check_folder(cfg.checkpoint_dir, "--checkpoint-dir")
        _check_checkpoints(cfg)
        from ..launch.run import launch

        print(f"microddp train: run folder {cfg.out}", flush=True)
        announced = True
        code = launch("microddp.train", cfg.to_argv(), nproc=cfg.nproc, module=True,
                      max_restarts=cfg.max_restarts)
        return code
    finally:
        # A run stopped or failed before it wrote anything leaves no empty folder behind.
        if code != 0 and created and outputs.discard_if_empty(folder) and announced:
            print(f"microddp train: removed {folder}: the run wrote nothing into it",
                  file=sys.stderr, flush=True)


def worker(cfg: TrainConfig) -> int:
    """One rank of the job: join the world, train, leave."""
    from .. import comms
    from ..checkpoint import broadcast_choice
    from .loop import train

    world = comms.init()
    try:
        validate(cfg, world.world_size)
        if cfg.out is None and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0:
            raise MicroDDPError("with --max-restarts, pass --out DIR: restarted workers find "
                                "the checkpoints to resume from there")
        if cfg.out is None:  # under torchrun: every rank takes rank 0's folder name
            cfg.out = broadcast_choice(default_out() if world.rank == 0 else None, world)
        error = None
        if world.rank == 0:
            try:
                check_folder(cfg.out, "--out")
            except MicroDDPError as e:
                error = str(e)
        error = broadcast_choice(error, world)
        if error:
            raise MicroDDPError(error)
        train(world, cfg)
    finally:
        comms.shutdown()
    return 0


def train(world, cfg: TrainConfig, on_step=None):
    """Run the job on this rank (see microddp.train.loop.train)."""
    from .loop import train as _train

    return _train(world, cfg, on_step)
