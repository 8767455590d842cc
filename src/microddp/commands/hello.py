"""Start N processes that introduce themselves and prove they can talk (course chapter 1)."""

from __future__ import annotations

import argparse

EPILOG = """\
example:
  microddp hello -n 4
prints, from each rank: its rank, world size, local rank, the launcher's environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), which share of the data it would
handle, and the sum of all ranks computed with one all_reduce.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `microddp hello`."""
    p.add_argument("-n", "--nproc", type=int, default=2, help="number of processes (default 2)")


def run(args: argparse.Namespace) -> int:
    """Launch `--nproc` ranks that introduce themselves and all-reduce their ranks."""
    from ..launch.run import launch

    return launch("microddp.commands.hello", [], nproc=args.nproc, module=True)


if __name__ == "__main__":  # the module each rank runs: `microddp run -m microddp.commands.hello`
    from ..launch.hello import worker  # here, not above: `microddp hello --help` needs no torch

    raise SystemExit(worker())
