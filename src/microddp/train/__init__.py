"""The training job: FullMLP on scikit-learn's handwritten digits (or synthetic data) with a
strategy (data parallel by default; pipeline, hybrid, ZeRO: strategies/), leaving a run folder
with metrics.jsonl, model.pt (the whole model's state_dict), curves.png and checkpoints to
resume from.

`start(cfg)` launches cfg.nproc local ranks; `worker(cfg)` is one rank (what `python -m
microddp.train` runs under a launcher); `train(world, cfg)` is the loop on a rank. The command
line is commands/train.py; the worker's arguments are config.add_arguments.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .. import outputs
from ..errors import MicroDDPError

# add_arguments: the flags `python -m microddp.train` (this package, run as a worker) accepts
from .config import TrainConfig, add_arguments, check_folder
from .strategies import entry as strategy_entry
from .validate import validate

__all__ = ["TrainConfig", "add_arguments", "start", "train", "worker"]

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


def start(cfg: TrainConfig) -> int:
    """Start the job on cfg.nproc local ranks; return its exit code.

    Checks what can be checked before any rank starts (settings, folders, checkpoints to
    resume), claims the run folder, and launches `python -m microddp.train` once per rank.
    """
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
        # async: a worker that dies is dropped by the server, so the launcher lets it go
        expendable = (range(cfg.servers, cfg.nproc) if strategy_entry(cfg.strategy).expendable
                      else ())
        code = launch("microddp.train", cfg.to_argv(), nproc=cfg.nproc, module=True,
                      max_restarts=cfg.max_restarts, expendable=expendable,
                      elastic=cfg.elastic, replacements=cfg.replacements)
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

    if cfg.elastic:  # forms and re-forms its own groups (train/elastic.py)
        return _elastic_worker(cfg)
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
        from ..monitor import flight

        flight.set_run_dir(cfg.out)  # a hang's Flight Recorder dumps go with the run's files
        train(world, cfg)
    finally:
        comms.shutdown()
    return 0


def _elastic_worker(cfg: TrainConfig) -> int:
    """One member of an elastic job: its run folder must be named (no rank 0 to choose it)."""
    from .elastic import run

    validate(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    if cfg.out is None:
        raise MicroDDPError("--elastic under a launcher: pass --out DIR (a folder every rank "
                            "sees); rank 0 may be lost, so it cannot choose one")
    check_folder(cfg.out, "--out")
    return run(cfg)


def train(world, cfg: TrainConfig, on_step=None):
    """Run the job on this rank (see microddp.train.loop.train)."""
    from .loop import train as _train

    return _train(world, cfg, on_step)
