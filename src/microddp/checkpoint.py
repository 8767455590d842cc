"""Checkpoints that survive a crash: atomic save from rank 0, safe load, exact resume.

A checkpoint is written to a temporary file, flushed to disk and renamed over its final name,
so a crash mid-write never leaves a half file under a checkpoint's name. Loading uses
`weights_only=True` (no arbitrary code from a file) and skips an unreadable newest file in
favour of the one before, with a warning naming it. Every file carries a digest of its own
contents (every tensor's bytes, every plain value), checked on load: a flipped byte in a
tensor, which torch's reader does not notice, makes the file unreadable instead of resuming
into a wrong model. Files are created with the permissions
the umask allows, as any other file the job writes.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .errors import MicroDDPError
from .transport.objects import broadcast_value, gather_values
from .world.world import World, distributed

FORMAT = 1
REQUIRED = ("format", "model", "optimizer", "step", "epoch", "position", "sampler", "rng",
            "world_size")
_NAME = re.compile(r"^ckpt-(\d+)(\.pt)?$")  # a file, or a folder of shards (train/sharded.py)


def path_for(folder: str | Path, step: int) -> Path:
    """The file of the checkpoint taken at `step` in `folder` (zero-padded, so names sort by
    step)."""
    return Path(folder) / f"ckpt-{step:08d}.pt"


def list_checkpoints(folder: str | Path) -> list[Path]:
    """Checkpoints in `folder`, oldest step first: ckpt-N.pt files and ckpt-N folders of
    shards (temporary files are ignored)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir()
             if (m := _NAME.match(p.name)) and (m.group(2) is not None) != p.is_dir()]
    return [p for _, p in sorted(found)]


def remove(path: Path) -> None:
    """Delete a checkpoint, a file or a folder of shards."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def prune(folder: Path, keep: int, final: Path) -> None:
    """Keep the newest `keep` checkpoints, and always `final` (the one just written)."""
    for old in list_checkpoints(folder)[:-keep]:
        if old != final:
            remove(old)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # some platforms cannot open a folder; the rename itself is still atomic
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    try:  # Linux shows it; reading it does not change it under other threads' feet
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


DIGEST = "digest"  # the key under which a saved dict carries the digest of the rest


def _feed(h, obj) -> None:
    """Hash `obj`'s contents in a fixed walk: types, keys, tensors' dtype, shape and bytes."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(obj.shape)}".encode())
        if t.numel():
            h.update(t.view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        h.update(f"D{len(obj)}".encode())
        for k, v in obj.items():
            _feed(h, k)
            _feed(h, v)
    elif isinstance(obj, (list, tuple)):
        h.update(f"{type(obj).__name__[0]}{len(obj)}".encode())
        for v in obj:
            _feed(h, v)
    else:  # int, float, str, bool, None, numpy scalars: repr is exact for each
        h.update(f"{type(obj).__name__}:{obj!r};".encode())


def digest(state: dict) -> str:
    """sha256 of `state`'s contents, its own digest entry left out."""
    h = hashlib.sha256()
    _feed(h, {k: v for k, v in state.items() if k != DIGEST})
    return h.hexdigest()


def verify(state, path) -> None:
    """MicroDDPError if `state` (loaded from `path`) does not match the digest saved with it.
    A file written before digests existed has none and is taken as it is."""
    if isinstance(state, dict) and DIGEST in state and digest(state) != state[DIGEST]:
        raise MicroDDPError(f"checkpoint {path} is damaged (its contents do not match the "
                            "digest saved with them: bytes changed on disk)")


def write_atomic(obj, final: Path) -> Path:
    """torch.save `obj` to `final` through a temporary file that is flushed to disk and then
    renamed: a reader (or a crash) never sees half a file under `final`'s name. A dict is
    saved with the digest of its contents (checked by `verify` on load)."""
    if isinstance(obj, dict):
        obj = {**obj, DIGEST: digest(obj)}
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes it 0600 whatever the umask
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(final.parent)  # make the rename itself durable
    return final


def save(state: dict, folder: str | Path, step: int, keep: int = 3) -> Path:
    """Write `state` as the checkpoint of `step` atomically, then keep only the newest `keep`.

    The file just written is never pruned, even if older runs left files with higher steps.
    """
    if keep < 1:
        raise MicroDDPError(f"keep must be at least 1 checkpoint, got {keep}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    final = write_atomic(state, path_for(folder, step))
    prune(folder, keep, final)
    # One writer, one file at a time: any other temporary file is debris of a killed writer.
    for debris in folder.glob(".ckpt-*.tmp"):
        debris.unlink(missing_ok=True)
    return final


def _why_unreadable(e: Exception) -> str:
    """The reason in our words: torch's own messages advise weights_only=False, which would run
    whatever code the file holds, the very thing the safe load is there to prevent."""
    text = str(e).strip()
    if "Unsupported global" in text:
        found = re.search(r"GLOBAL ([\w.]+)", text)
        what = f" ({found.group(1)})" if found else ""
        return (f"it holds a Python object{what} that a safe load will not create; microddp "
                "saves only tensors and plain data, so the file is not its own or was altered")
    if isinstance(e, EOFError) or not text:
        return "empty or cut short"
    first = text.splitlines()[0].split(". ")[0].rstrip(".")
    detail = "" if "weights_only" in text.lower() or "weights only" in text.lower() else \
        f": {first}"
    return f"damaged, cut short, or not a PyTorch file{detail}"


def load(path: str | Path, map_location: torch.device | str = "cpu") -> dict:
    """Read one checkpoint safely; MicroDDPError if it is unreadable or incomplete."""
    try:
        with warnings.catch_warnings():  # e.g. about pickle protocols: the error says enough
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # truncated zip, bad pickle, unsupported type: all mean "corrupt"
        raise MicroDDPError(f"checkpoint {path} is unreadable ({_why_unreadable(e)})") from None
    verify(state, path)
    missing = [k for k in REQUIRED if not isinstance(state, dict) or k not in state]
    if missing:
        raise MicroDDPError(f"checkpoint {path} is incomplete (missing {', '.join(missing)})")
    if state["format"] != FORMAT:
        raise MicroDDPError(f"checkpoint {path} has format {state['format']}, expected {FORMAT}; "
                            "it was written by another microddp version")
    return state


def _warn(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def load_latest(folder: str | Path, map_location: torch.device | str = "cpu",
                warn: Callable[[str], None] = _warn) -> tuple[dict, Path] | None:
    """The newest readable checkpoint in `folder` (and its path), or None if there is none.

    An unreadable newer file is reported through `warn` and skipped, so a crash that damaged
    the last checkpoint costs only the steps since the one before. What to do when none is
    readable is the caller's decision.
    """
    candidates = list_checkpoints(folder)
    found, skipped = newest_readable(candidates, map_location)
    for k, e in enumerate(skipped):  # the k-th newest; the oldest has nothing to fall back to
        warn(f"{e}; falling back to the previous checkpoint" if k < len(candidates) - 1
             else str(e))
    return found


def newest_readable(paths: list[Path], map_location: torch.device | str = "cpu",
                    loader: Callable[[Path, torch.device | str], dict] | None = None,
                    ) -> tuple[tuple[dict, Path] | None, list[MicroDDPError]]:
    """(state, path) of the newest of `paths` that loads, or None; and why each newer one
    did not, newest first. `loader` reads one checkpoint (default `load`: one file)."""
    skipped = []
    for path in reversed(paths):
        try:
            return ((loader or load)(path, map_location), path), skipped
        except MicroDDPError as e:
            skipped.append(e)
    return None, skipped


def set_aside(paths: list[Path]) -> list[Path]:
    """Rename unreadable checkpoints to NAME.unreadable (kept for a look, no longer listed), so
    that a run starting afresh neither resumes from them nor counts them among its newest."""
    moved = []
    for path in paths:
        target, i = path.with_name(path.name + ".unreadable"), 1
        while target.exists():
            target, i = path.with_name(f"{path.name}.unreadable.{i}"), i + 1
        path.rename(target)
        moved.append(target)
    return moved


def rng_state() -> dict:
    """Every random generator this process may draw from, in a weights_only-loadable form."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore every random generator (torch, Python, NumPy, CUDA) saved by `rng_state`, so a
    resumed run draws the same numbers."""
    torch.set_rng_state(state["torch"].cpu())
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.cpu().numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def gather_rng_states(world: World) -> list[dict] | None:
    """Every rank's RNG states, on rank 0 (None elsewhere): one process writes the file."""
    mine = rng_state()
    if not distributed():
        return [mine]
    return gather_values(mine, dst=0)  # tensors and JSON, never pickle


def broadcast_choice(value, world: World):
    """Rank 0's `value` on every rank, so all ranks act on the same decision."""
    if not distributed():
        return value
    return broadcast_value(value, src=0)


def save_from_rank0(make_state: Callable[[], dict], folder: str | Path, step: int,
                    world: World, keep: int = 3) -> Path:
    """Collect per-rank RNG states, let rank 0 write, then hold every rank at a barrier.

    The barrier means no rank runs ahead (and possibly crashes) before the file is complete,
    so after a restart every rank resumes from the same step.
    """
    rngs = gather_rng_states(world)
    path = path_for(folder, step)
    error = None
    if world.rank == 0:
        state = make_state()
        state["rng"] = rngs
        try:
            save(state, folder, step, keep)
        except OSError as e:
            error = f"cannot write checkpoint {path}: {e.strerror or e}; free space or pick " \
                    "another --checkpoint-dir"
    error = broadcast_choice(error, world)
    if distributed():
        dist.barrier()
    if error:
        raise MicroDDPError(error)
    return path
