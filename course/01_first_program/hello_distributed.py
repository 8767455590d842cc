"""Chapter 1, script 2: your first distributed program.

    python course/01_first_program/hello_distributed.py                 # 4 processes
    python course/01_first_program/hello_distributed.py --world-size 8  # exercise 1

torch.multiprocessing.spawn starts the processes and hands each its rank; every process then
joins the same process group (the "conference call") and they add up their ranks together.
"""

import argparse
import os
import socket
import sys

import torch
import torch.multiprocessing as mp

import microddp as mdp

ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def worker(rank: int, world_size: int, port: int) -> None:
    """Runs in every process; mp.spawn passes `rank` (0 .. world_size-1) first."""
    world = mdp.init(backend="gloo", init_method=f"tcp://127.0.0.1:{port}",
                     rank=rank, world_size=world_size)

    def say(msg: str) -> None:
        # One write per line: print() writes the text and the newline separately, and with
        # unbuffered output another rank's line can land between the two.
        sys.stdout.write(f"[rank {rank}] {msg}\n")
        sys.stdout.flush()

    say(f"hello! rank {world.rank} of world size {world.world_size}, "
        f"local rank {world.local_rank}, backend {world.backend}")
    # Exercise 2: the same program, a different slice of the data on every rank.
    say(f"I handle samples {rank}, {rank + world_size}, {rank + 2 * world_size}, ... "
        f"(1 in {world_size})")
    # Exercise 3: mp.spawn sets none of these; torchrun and `microddp run` set them all.
    say("env: " + " ".join(f"{k}={os.environ.get(k, 'not set')}" for k in ENV_VARS))
    # Proof that they talk: everyone contributes its rank, everyone receives the sum.
    total = torch.tensor([rank])
    mdp.comms.all_reduce(total, "sum")
    say(f"sum of all ranks = {total.item()} (expected {world_size * (world_size - 1) // 2})")
    mdp.shutdown()


def free_port() -> int:
    """Ask the OS for a port nobody uses right now (never assume 29500 is free)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=4, help="number of processes")
    args = parser.parse_args()
    if args.world_size < 1:
        parser.error("--world-size must be at least 1")
    # Processes, not threads: each has its own interpreter, so the GIL never serialises them.
    mp.spawn(worker, args=(args.world_size, free_port()), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
