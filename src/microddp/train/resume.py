"""Deciding whether a run starts fresh or continues from a checkpoint, and restoring it.

Rank 0 decides and broadcasts the decision, so every rank resumes from the same file or all
stop with the same error.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .. import checkpoint
from ..errors import MicroDDPError
from ..world.world import World
from . import sharded
from .config import TrainConfig


def restart_count() -> int:
    """How many times the launcher (microddp, torchrun) has restarted this group of workers."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _ignore(message: str) -> None:
    pass


def decide(cfg: TrainConfig, restarted: bool = False,
           warn=_ignore) -> tuple[str | None, str | None]:
    """(checkpoint to resume from or None, error or None) for a run with `cfg`.

    The launcher asks first, before starting any rank, so a mistake costs one line; then
    rank 0 of the job asks again (the job may run under torchrun, or be a restart).
    """
    folder = cfg.ckpt_dir
    existing = checkpoint.list_checkpoints(folder)
    if not existing:
        if cfg.resume and not restarted:
            return None, (f"--resume: no checkpoint in {folder}; check the folder, or drop "
                          "--resume to start a new run")
        return None, None  # restarted before the first checkpoint: start again from scratch
    found, skipped = checkpoint.newest_readable(existing, loader=load_any)
    if found is None:
        if cfg.resume or not restarted:
            newest = str(skipped[0]).replace(f"checkpoint {existing[-1]} ", "")
            return None, (f"{folder} holds {len(existing)} checkpoint(s), none of them "
                          f"readable (the newest, {existing[-1].name}, {newest}); move them "
                          "away or choose a new --out / --checkpoint-dir")
        # A restart of this very run, whose files all broke: start over, without them.
        moved = checkpoint.set_aside(existing)
        warn(f"none of the {len(moved)} checkpoint(s) in {folder} is readable; renamed them "
             "to *.unreadable and starting this restart from scratch")
        return None, None
    if not (cfg.resume or restarted):
        return None, (f"{folder} already holds checkpoints of an earlier run; pass --resume "
                      "to continue it, or choose a new --out / --checkpoint-dir")
    for problem in skipped:
        warn(f"{problem}; resuming from the older {found[1].name} instead")
    state, path = found
    theirs, ours = state.get("config", {}), cfg.resume_settings()
    changed = [k for k in ours if k in theirs and theirs[k] != ours[k]]
    if changed:
        diffs = ", ".join(f"--{k.replace('_', '-')} {theirs[k]} (now {ours[k]})" for k in changed)
        return None, (f"checkpoint {path.name} was made with {diffs}; resume with the same "
                      "settings, or start a new run in another folder")
    return str(path), None


def load_any(path: Path, map_location="cpu") -> dict:
    """A checkpoint's state: a file (dp), or a folder of shards' common state (sharded.py)."""
    if Path(path).is_dir():
        return sharded.read(path, map_location)
    return checkpoint.load(path, map_location)


def find(cfg: TrainConfig, world: World) -> dict | None:
    """The checkpoint this run continues from (loaded onto this rank's device), or None."""
    decision = decide(cfg, restart_count() > 0, _warn) if world.rank == 0 else (None, None)
    path, error = checkpoint.broadcast_choice(decision, world)
    if error:
        raise MicroDDPError(error)
    if path is None:
        return None
    try:
        state = load_any(path, map_location=world.device)
    except MicroDDPError as e:
        raise MicroDDPError(f"rank {world.rank}: {e}; every rank must see the checkpoint "
                            "folder (a shared file system)") from None
    state["path"] = path
    return state


def restore(state: dict, world: World, strategy, precision, sampler) -> int:
    """Put every piece back as it was when `state` was saved; return its optimizer step."""
    shards = "manifest" in state
    if shards != strategy.sharded_checkpoints:
        kinds = {True: "a folder of shards", False: "one file"}
        raise MicroDDPError(f"checkpoint {Path(state['path']).name} is {kinds[shards]}, but "
                            f"--strategy {strategy.name} keeps {kinds[not shards]}; resume "
                            "with the strategy that saved it")
    if shards:
        strategy.load_shards(Path(state["path"]), state["manifest"])
    else:
        strategy.load_state_dict(state)
    precision.load_state_dict(state.get("scaler"))
    sampler.load_state_dict(state["sampler"])
    rngs = state["rng"]
    # After a world-size change there is no saved stream for a new rank; rank 0's is a
    # deterministic stand-in (the job itself draws no random numbers after start-up).
    checkpoint.set_rng_state(rngs[world.rank] if world.rank < len(rngs) else rngs[0])
    return int(state["step"])


def describe(state: dict, world: World) -> str:
    """One line saying where a resumed run picks up, and why results may differ by rounding if
    the world size changed."""
    text = (f"resuming from {Path(state['path']).name}: step {state['step']}, "
            f"epoch {state['sampler']['epoch'] + 1}, batch {state['sampler']['position']}")
    if state["world_size"] != world.world_size:
        text += (f" (saved by {state['world_size']} ranks, now {world.world_size}"
                 + (", re-sharded" if "manifest" in state else "") + ": the same "
                 "samples in every step, summed in another order, so results agree to "
                 "rounding rather than bit for bit)")
    return text
