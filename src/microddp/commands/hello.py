"""Start N processes that introduce themselves and prove they can talk (course chapter 1)."""

from __future__ import annotations

import argparse
import os
import sys

EPILOG = """\
example:
  microddp hello -n 4
prints, from each rank: its rank, world size, local rank, the launcher's environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), which share of the data it would
handle, and the sum of all ranks computed with one all_reduce.
"""

ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--nproc", type=int, default=2, help="number of processes (default 2)")


def run(args: argparse.Namespace) -> int:
    from ..launch.run import launch

    return launch("microddp.commands.hello", [], nproc=args.nproc, module=True)


def say(line: str) -> None:
    """Print a whole line in one write: under torchrun the ranks share one stdout, and print()
    writes the text and the newline separately, so unbuffered lines could interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def share(rank: int, world_size: int) -> str:
    """Which samples this rank would train on: every world_size-th, starting at its rank."""
    first = ", ".join(str(rank + k * world_size) for k in range(3))
    return f"I handle samples {first}, ... (1 in {world_size})"


def worker() -> int:
    """What each rank does; runs under `microddp run`, torchrun, or alone."""
    import torch

    from .. import comms

    world = comms.init()
    say(f"hello from rank {world.rank} of {world.world_size} "
        f"(local rank {world.local_rank}, backend {world.backend or 'none'}, "
        f"device {world.device})")
    say("environment: " + " ".join(f"{k}={os.environ.get(k, 'not set')}" for k in ENV_VARS))
    say(f"rank {world.rank}: {share(world.rank, world.world_size)}")
    total = torch.tensor([world.rank], dtype=torch.int64, device=world.device)
    comms.all_reduce(total, "sum")
    expected = world.world_size * (world.world_size - 1) // 2
    say(f"all_reduce(sum of ranks) = {int(total.item())} (expected {expected})")
    comms.shutdown()
    return 0 if int(total.item()) == expected else 1


if __name__ == "__main__":
    raise SystemExit(worker())
