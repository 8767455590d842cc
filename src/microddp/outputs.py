"""Where a command's files go: one convention for every command that writes any.

Each run gets a new folder, runs/<command>-YYYYmmdd-HHMMSS (with -2, -3 ... when two runs
start in the same second), unless the user names one with --out; an earlier run's files are
never replaced behind the user's back. Files are written to a temporary name and renamed, so
a reader (or an interrupt) never sees half a file; and a folder this run created is removed
again if the run fails or is interrupted before anything is in it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from .errors import MicroDDPError

RUNS = "runs"


def new_run_dir(command: str, root: str | os.PathLike = RUNS) -> Path:
    """Create and return a folder of its own for this run of `command`.

    The name is claimed with an exclusive mkdir, so two runs started in the same second (even
    in two processes) never share a folder.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(root) / f"{command}-{stamp}"
    Path(root).mkdir(parents=True, exist_ok=True)
    for i in range(1, 10_000):
        path = base if i == 1 else base.with_name(f"{base.name}-{i}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise MicroDDPError(f"could not find a free folder name like {base} in {root}; "
                        "give one with --out")


def claim(out: str | None, command: str) -> tuple[Path, bool]:
    """The folder for this run, created now so a bad --out fails before any work; and
    whether this call created it (only then may a failed run remove it)."""
    if out is None:
        return new_run_dir(command), True
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise MicroDDPError(f"--out {path} is a file, not a folder; give a folder path")
    existed = path.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MicroDDPError(f"--out {path} is not writable ({e.strerror}); choose a folder "
                            "you can write to") from None
    return path, not existed


def holds_nothing(path: Path) -> bool:
    """True if `path` has no file with content anywhere inside it (empty files and empty
    sub-folders are what an interrupted start leaves, and nothing worth keeping)."""
    for folder, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                if (Path(folder) / name).stat().st_size > 0:
                    return False
    return True


def discard_if_empty(path: Path) -> bool:
    """Remove a run folder that holds nothing; True if it was removed."""
    if path.is_dir() and holds_nothing(path):
        shutil.rmtree(path, ignore_errors=True)
        return True
    return False


@contextlib.contextmanager
def run_folder(out: str | None, command: str) -> Iterator[Path]:
    """`claim` a folder for the body; if the body fails or is interrupted and the folder is
    one it created, remove the folder again when nothing useful was written into it."""
    path, created = claim(out, command)
    try:
        yield path
    except BaseException:
        if created:
            discard_if_empty(path)
        raise


def temporary_name(path: str | os.PathLike) -> Path:
    """A sibling of `path` to write first, with the same suffix (matplotlib picks the format
    from it) and this process's id (two writers never share it)."""
    p = Path(path)
    return p.with_name(f".{p.stem}.tmp{os.getpid()}{p.suffix}")


@contextlib.contextmanager
def atomic(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path to write; rename it to `path` only once the body succeeded."""
    tmp = temporary_name(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write a whole text file atomically (tmp then rename)."""
    with atomic(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def wrote(paths: list, prefix: str = "wrote") -> str:
    """The closing line of a command: every file (or folder) it wrote, in order."""
    return f"{prefix} " + ", ".join(str(p) for p in paths if p is not None)
