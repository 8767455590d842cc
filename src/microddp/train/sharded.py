"""Sharded checkpoints: every rank writes the part of the model state it holds, and a manifest
written last says which files make the checkpoint and which run they belong to.

    ckpt-00000020/
      shard-00000.pt  shard-00001.pt ...   each rank's pieces: parameter elements, their
                                           optimizer state (Adam's moments, SGD's momentum)
      common.pt                            rank 0: step, sampler, RNG streams, loss sums, config
      manifest.json                        written last: run id, world size, every file's size

A piece is a run of elements of one parameter, named as in the whole model's state_dict
(`net.2.weight`, elements 130..259). Because a piece says which elements it holds, any layout
reads any other: a ZeRO checkpoint saved on 4 ranks resumes on 3 (each rank takes the elements
its new shard owns from whichever files hold them), a pipeline's stages find their layers by
name. No rank ever gathers the whole state. Each file is written to a temporary name and
renamed (checkpoint.write_atomic); a folder without its manifest is an interrupted save.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .. import checkpoint, outputs
from ..errors import MicroDDPError
from ..transport.objects import all_gather_values
from ..world.world import World, distributed

FORMAT = 1
MANIFEST, COMMON = "manifest.json", "common.pt"


@dataclass
class Piece:
    """`param` is a live flat view of elements [start, start + len) of the model's parameter
    `name`; the optimizer steps them as elements [at, at + len) of `opt_tensor` (the parameter
    itself, or a ZeRO shard), whose state holds their moments."""

    name: str
    start: int
    param: torch.Tensor
    opt_tensor: torch.Tensor
    at: int = 0


def shard_name(rank: int) -> str:
    """The file name of one rank's shard in a checkpoint folder."""
    return f"shard-{rank:05d}.pt"


def _pack(pieces: Sequence[Piece], optimizer: torch.optim.Optimizer) -> list[dict]:
    out = []
    for pc in pieces:
        n = pc.param.numel()
        state, scalars = {}, {}
        for key, value in optimizer.state.get(pc.opt_tensor, {}).items():
            if isinstance(value, torch.Tensor) and value.shape == pc.opt_tensor.shape:
                state[key] = value.detach().reshape(-1).narrow(0, pc.at, n).clone()
            elif isinstance(value, torch.Tensor):
                scalars[key] = value.detach().clone()  # Adam's step count: one per tensor
        out.append({"name": pc.name, "start": pc.start, "param": pc.param.detach().clone(),
                    "state": state, "scalars": scalars})
    return out


def save(folder: Path, world: World, run: str, pieces: Sequence[Piece],
         optimizer: torch.optim.Optimizer, common: Callable[[], dict], keep: int,
         strategy: str) -> Path:
    """Every rank writes its pieces into `folder` (a ckpt-N folder); rank 0 then writes the
    common state and the manifest, and prunes old checkpoints. Every rank must call it."""
    rngs = checkpoint.gather_rng_states(world)
    error = None
    try:
        if world.rank == 0 and folder.exists():  # a restart saving the same step again
            checkpoint.remove(folder)
        _barrier()
        folder.mkdir(parents=True, exist_ok=True)
        checkpoint.write_atomic({"format": FORMAT, "run": run, "rank": world.rank,
                                 "world_size": world.world_size,
                                 "pieces": _pack(pieces, optimizer)},
                                folder / shard_name(world.rank))
    except OSError as e:
        error = f"rank {world.rank} cannot write its shard in {folder}: {e.strerror or e}"
    errors = _gather(error, world)
    if world.rank == 0:
        error = next((e for e in errors if e), None)
        if error is None:
            try:
                state = common()
                state["rng"], state["run"] = rngs, run
                checkpoint.write_atomic(state, folder / COMMON)
                files = {name: (folder / name).stat().st_size
                         for name in [shard_name(r) for r in range(world.world_size)] + [COMMON]}
                manifest = {"format": FORMAT, "run": run, "step": state["step"],
                            "world_size": world.world_size, "strategy": strategy,
                            "files": files}
                outputs.write_text(folder / MANIFEST, json.dumps(manifest, indent=1))
                checkpoint.prune(folder.parent, keep, folder)
            except OSError as e:
                error = f"cannot write checkpoint {folder}: {e.strerror or e}"
    error = checkpoint.broadcast_choice(error, world)
    _barrier()  # no rank runs ahead before the checkpoint is whole
    if error:
        raise MicroDDPError(f"{error}; free space or pick another --checkpoint-dir")
    return folder


def _barrier() -> None:
    if distributed():
        dist.barrier()


def _gather(value, world: World) -> list:
    if not distributed():
        return [value]
    return all_gather_values(value)


def read(folder: str | Path, map_location: torch.device | str = "cpu") -> dict:
    """The common state of a sharded checkpoint (with its manifest under "manifest"), after
    checking that every shard is there, whole, and of this checkpoint's run."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files, run = manifest["files"], manifest["run"]
    except FileNotFoundError:
        raise MicroDDPError(f"checkpoint {folder} is incomplete (no {MANIFEST}: its save was "
                            "interrupted)") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise MicroDDPError(f"checkpoint {folder} has an unreadable {MANIFEST} ({e})") from None
    if manifest.get("format") != FORMAT:
        raise MicroDDPError(f"checkpoint {folder} has format {manifest.get('format')}, expected "
                            f"{FORMAT}; it was written by another microddp version")
    for name in files:
        if not (folder / name).is_file():
            raise MicroDDPError(f"checkpoint {folder} is missing {name}, one of the "
                                f"{len(files)} files its manifest lists")
    for name, size in files.items():
        head = _load(folder / name, "cpu", mmap=True)  # mapped: the tensors stay on disk
        if head.get("run") != run:
            raise MicroDDPError(f"checkpoint {folder}: {name} belongs to run "
                                f"{head.get('run')}, the checkpoint to run {run}; the "
                                "folder mixes two runs' files")
        if (folder / name).stat().st_size != size:
            raise MicroDDPError(f"checkpoint {folder}: {name} holds "
                                f"{(folder / name).stat().st_size} bytes, its manifest says "
                                f"{size} (damaged or replaced)")
    state = _load(folder / COMMON, map_location)
    missing = [k for k in checkpoint.REQUIRED if k not in state and k not in ("model",
                                                                            "optimizer")]
    if missing:
        raise MicroDDPError(f"checkpoint {folder} is incomplete (missing {', '.join(missing)})")
    state["format"] = checkpoint.FORMAT
    state["manifest"] = manifest
    return state


def _load(path: Path, map_location, mmap: bool = False, verify: bool = True) -> dict:
    try:
        out = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:  # noqa: BLE001 (a damaged file, whatever torch says about it)
        raise MicroDDPError(f"checkpoint file {path} is unreadable ({str(e).splitlines()[0]})"
                            ) from None
    if not isinstance(out, dict):
        raise MicroDDPError(f"checkpoint file {path} is not a microddp shard")
    if verify:
        checkpoint.verify(out, path)
    return out


def load(folder: Path, manifest: dict, pieces: Sequence[Piece],
         optimizer: torch.optim.Optimizer) -> None:
    """Fill this rank's `pieces` (and their optimizer state) from a checkpoint saved with any
    layout: each saved piece that overlaps one of ours gives it the shared elements."""
    by_name: dict[str, list[Piece]] = {}
    for pc in pieces:
        by_name.setdefault(pc.name, []).append(pc)
    filled = {id(pc): 0 for pc in pieces}
    shards = sorted(n for n in manifest["files"] if n != COMMON)
    for name in shards:
        # read() checked every file's digest (it picks the checkpoint to resume from)
        saved = _load(folder / name, "cpu", mmap=True, verify=False)["pieces"]
        for entry in saved:
            for pc in by_name.get(entry["name"], ()):
                filled[id(pc)] += _copy_overlap(entry, pc, optimizer)
    short = [f"{pc.name}[{pc.start}:{pc.start + pc.param.numel()}]" for pc in pieces
             if filled[id(pc)] != pc.param.numel()]
    if short:
        raise MicroDDPError(f"checkpoint {folder} does not hold every element this rank needs "
                            f"(e.g. {short[0]}); it was saved for another model")


def _copy_overlap(entry: dict, pc: Piece, optimizer: torch.optim.Optimizer) -> int:
    lo = max(entry["start"], pc.start)
    hi = min(entry["start"] + entry["param"].numel(), pc.start + pc.param.numel())
    if lo >= hi:
        return 0
    n, src, dst = hi - lo, lo - entry["start"], lo - pc.start
    pc.param.narrow(0, dst, n).copy_(entry["param"].narrow(0, src, n))
    state = optimizer.state.setdefault(pc.opt_tensor, {})
    for key, value in entry["state"].items():
        if key not in state:  # a fresh optimizer makes its state at the first step
            state[key] = torch.zeros_like(pc.opt_tensor)
        state[key].view(-1).narrow(0, pc.at + dst, n).copy_(value.narrow(0, src, n))
    for key, value in entry["scalars"].items():
        state[key] = value.clone().to(state.get(key, value).device)
    return n


def new_run_id(world: World) -> str:
    """A name for this run, the same on every rank: its shards carry it."""
    return checkpoint.broadcast_choice(os.urandom(8).hex() if world.rank == 0 else None, world)
