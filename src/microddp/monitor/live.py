"""Where every rank is, while the job runs: a small status file per rank, and the view of them.

The monitor's watchdog already wakes every poll and knows this rank's open collective, its last
finished one and the line the main thread is on (hang.py, log.py). When the job has a run
folder (flight.run_dir), it writes that, with the training step (set_step), to
RUN/status/rank_N.json about once a second; `microddp status RUN` reads the files and says,
for each rank, its step, what it is in and for how long, and which rank the others wait for.
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
STALE_S = 5.0  # a file older than this: the rank's watchdog stopped (exited, frozen, killed)
WAITING_S = 1.0  # a collective open longer than this on some rank: someone is waited for

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
            "since": wall - (now - entry.started)},
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


def read(folder: str | os.PathLike) -> dict[int, dict]:
    """Every rank's last status in RUN/status/, by rank."""
    out = {}
    for path in sorted((Path(folder) / FOLDER).glob("rank_*.json")):
        try:
            st = json.loads(path.read_text())
        except (OSError, ValueError):  # being replaced this instant: the next look has it
            continue
        out[int(st["rank"])] = st
    return out


def _call(c: dict | None) -> str:
    if c is None:
        return "-"
    grp = "" if c["group"] == "world" else f" on group {c['group']}"
    return f"{c['op']} #{c['seq']}{grp}"


def waited_for(statuses: dict[int, dict], now: float) -> dict[int, str]:
    """The ranks the others wait for, and why: when some rank has been in a collective for
    over WAITING_S, every rank that is not in that same collective (same group and number),
    and every rank whose file went stale."""
    why: dict[int, str] = {}
    open_ = [(st["in"]["since"], r) for r, st in statuses.items() if st["in"] is not None]
    if open_:
        since, r0 = min(open_)
        if now - since > WAITING_S:
            c = statuses[r0]["in"]
            key = (c["group"], c["seq"], c["op"])
            for r, st in statuses.items():
                i = st["in"]
                if i is None or (i["group"], i["seq"], i["op"]) != key:
                    why[r] = f"not in {_call(c)}, where rank {r0} waits"
    for r, st in statuses.items():
        if now - st["time"] > STALE_S:
            why[r] = f"no news for {now - st['time']:.0f} s (exited, frozen or killed)"
    return why


def render(folder: str | os.PathLike, statuses: dict[int, dict], now: float | None = None,
           world_size: int | None = None) -> str:
    """The table `microddp status` prints."""
    now = time.time() if now is None else now
    if not statuses:
        return f"{folder}: no rank status yet (the job writes {FOLDER}/rank_N.json once it runs)"
    late = waited_for(statuses, now)
    rows = [("rank", "step", "in collective", "for", "last finished", "where")]
    for r, st in sorted(statuses.items()):
        i = st["in"]
        took = f"{now - i['since']:.1f} s" if i is not None else "-"
        last = st["last"]
        done = "-" if last is None else f"{_call(last)} ({last['ms']:.2f} ms)"
        rows.append((str(r), "-" if st["step"] is None else str(st["step"]), _call(i), took,
                     done, st["where"]))
    widths = [max(len(row[k]) for row in rows) for k in range(5)]
    lines = [f"microddp status {folder}: {len(statuses)} ranks, "
             f"{time.strftime('%H:%M:%S', time.localtime(now))}"]
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False))
                     + "  " + row[5])
    size = world_size or max(st.get("world_size", 0) for st in statuses.values())
    missing = [r for r in range(size) if r not in statuses]
    for r in missing:
        late.setdefault(r, "no status file (not started, or no monitor)")
    for r, why in sorted(late.items()):
        lines.append(f"waited for: rank {r}: {why}")
    if not late:
        lines.append("no rank is waited for")
    return "\n".join(line.rstrip() for line in lines)
