"""Where every rank of a running job is: step, open collective and for how long, who is waited for.

Reads the status files the hang monitor of each rank keeps in RUN/status/ (monitor/live.py)
while the job runs, and prints one row per rank; `--watch` prints again every second.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from ..errors import MicroDDPError

FOLDER = "status"  # where monitor/live.py writes (live.FOLDER; this module loads no torch)
STALE_S = 5.0  # a file older than this: the rank's watchdog stopped (exited, frozen, killed)
WAITING_S = 1.0  # a collective open longer than this on some rank: someone is waited for

EPILOG = """\
examples:
  microddp status runs/train-20260101-120000
  microddp status runs/my-job --watch
a rank that has been in a collective for over a second while another rank is elsewhere (or
whose file went stale) is named on a `waited for:` line.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `microddp status`."""
    p.add_argument("run", help="the job's run folder (train's --out, or MICRODDP_RUN_DIR)")
    p.add_argument("--watch", action="store_true", help="print again every second until Ctrl-C")


def run(args: argparse.Namespace) -> int:
    """Print the status table of the run folder `args.run`."""
    folder = Path(args.run)
    if not folder.is_dir():
        raise MicroDDPError(f"{folder} is not a folder; give the job's run folder (its --out)")
    while True:
        print(render(folder, read(folder)), flush=True)
        if not args.watch:
            return 0
        try:
            time.sleep(1.0)
        except KeyboardInterrupt:
            return 0
        print()


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
        # in a collective, the line that called it (the main thread is inside microddp's wait)
        where = i.get("caller") or st["where"] if i is not None else st["where"]
        rows.append((str(r), "-" if st["step"] is None else str(st["step"]), _call(i), took,
                     done, where))
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
