"""Where every rank is, while the job runs: a small status file per rank, and the view of them.

The monitor's watchdog already wakes every poll and knows this rank's open collective, its last
finished one and the line the main thread is on (hang.py, log.py). When the job has a run
folder (flight.run_dir), it writes that, with the training step (set_step), to
RUN/status/rank_N.json about once a second; `microddp status RUN` (commands/status.py, which
needs no torch, so it answers at once) reads the files and says, for each rank, its step, what
it is in and for how long, and which rank the others wait for.
Plain files, not a port: they work for ranks on other hosts with a shared run folder, and
after the job is gone they still say where each rank last was.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from .log import CollectiveLog, main_thread_where

FOLDER = "status"
EVERY_S = 1.0  # how often a rank rewrites its file: often enough for a person watching

_step: list = [None]


def set_step(step: int | None) -> None:
    """Say which training step this rank is on (one assignment; the file shows it)."""
    _step[0] = step


def snapshot(rank: int, world_size: int, log: CollectiveLog) -> dict:
    """This rank's status now: step, open collective (since when), last finished one, line."""
    now, wall = time.monotonic(), time.time()
    entry = log.oldest_open()
    last = log.last_done()
    return {
        "rank": rank, "world_size": world_size, "pid": os.getpid(), "host": socket.gethostname(), "time": wall,
        "step": _step[0],
        "in": None if entry is None else {
            "op": entry.op, "seq": entry.seq, "group": entry.group,
            "since": wall - (now - entry.started), "caller": entry.caller},
        "last": None if last is None else {
            "op": last.op, "seq": last.seq, "group": last.group,
            "ms": (last.done - last.started) * 1e3},
        "where": main_thread_where(),
    }


def write(folder: str | os.PathLike, status: dict) -> None:
    """Replace this rank's file in RUN/status/ (renamed into place: never half a file)."""
    path = Path(folder) / FOLDER / f"rank_{status['rank']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(status))
    os.replace(tmp, path)
