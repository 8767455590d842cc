"""What each rank of `microddp hello` does: join the world, introduce itself (rank, world size,
the launcher's environment, its share of the data) and prove the ranks can talk with one
all_reduce. It runs under `microddp run`, torchrun, or alone (a world of one)."""

from __future__ import annotations

import os
import sys

ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


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
    """One rank's introduction; 0 when the all_reduce gave the expected sum, else 1."""
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
