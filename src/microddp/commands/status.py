"""Where every rank of a running job is: step, open collective and for how long, who is waited for.

Reads the status files the hang monitor of each rank keeps in RUN/status/ (monitor/live.py)
while the job runs, and prints one row per rank; `--watch` prints again every second.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ..errors import MicroDDPError

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
    from ..monitor import live

    folder = Path(args.run)
    if not folder.is_dir():
        raise MicroDDPError(f"{folder} is not a folder; give the job's run folder (its --out)")
    while True:
        print(live.render(folder, live.read(folder)), flush=True)
        if not args.watch:
            return 0
        try:
            time.sleep(1.0)
        except KeyboardInterrupt:
            return 0
        print()
