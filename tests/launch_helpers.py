"""Running `microddp` as a user does, for the launcher's tests (not a test module itself)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import psutil

DEADLINE = 60  # seconds; a launcher that fails to stop its workers fails the test, never hangs


def microddp(*args, timeout=DEADLINE, cwd=None):
    return subprocess.run([sys.executable, "-m", "microddp", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)


def write(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def rank_pid(launcher: psutil.Process, rank: int) -> int | None:
    """The pid of the worker with RANK=`rank` among `launcher`'s descendants, or None."""
    for child in launcher.children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank):
                return child.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None
