"""Chapter 7, script 4: a planted hang and a planted desync, for PyTorch's own tools to read.

    python course/07_observability/flight_recorder.py skip runs/fr-skip     # rank 1 skips one
    python course/07_observability/flight_recorder.py bcast runs/fr-bcast   # broadcast vs all_reduce
    torchfrtrace runs/fr-skip/flight_recorder        # torch's analyser on microddp's dumps
    microddp status runs/fr-skip                     # meanwhile, from another terminal

The monitor's report names every rank's place; each rank also leaves a Flight Recorder dump
(RUN/flight_recorder/fr_trace_rank_N) that torch's `torchfrtrace` reads, and, while the job
runs, a status file that `microddp status RUN` shows.
"""

import sys
import time

import torch

import microddp as mdp
from microddp import monitor

RANKS = {"skip": 2, "bcast": 3}


def save_checkpoint(seconds: float) -> None:
    """Rank 1 takes its time here while the others wait in the next all-reduce."""
    time.sleep(seconds)


def job(world, case: str, run: str):
    monitor.set_run_dir(run)  # dumps and status files go with the run
    monitor.enable(timeout=8)
    grads = torch.ones(1024)
    for step in range(1, 4):
        monitor.set_step(step)
        if step == 3 and world.rank == 1:
            if case == "skip":
                save_checkpoint(15)  # the bug: rank 1 skips this step's all-reduce
                continue
            mdp.comms.broadcast(grads, src=0)  # the bug: the others all-reduce
            continue
        mdp.comms.all_reduce(grads)
    return "finished"


def main() -> None:
    case, run = sys.argv[1], sys.argv[2]
    try:
        mdp.spawn(job, RANKS[case], args=(case, run), timeout=90, backend="gloo")
        print("no error")
    except mdp.MicroDDPError as e:  # "rank k failed: MicroDDPError: <report>\nTraceback ..."
        print(str(e).split("MicroDDPError: ", 1)[-1].split("\nTraceback")[0].strip())


if __name__ == "__main__":
    main()
