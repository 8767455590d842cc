"""Chapter 7, script 3: a job that hangs, a job whose ranks disagree, a replica that drifts.

    python course/07_observability/debug_hang.py

With microddp.monitor on, each rank logs its collectives (number, op, shape, calling line).
When one stalls, every rank that can still answer says where it is, through the rendezvous
store, and one report names them all; PyTorch alone would wait 30 minutes and say nothing
about the other ranks. Debug mode compares each collective's shape and op across ranks before
it runs. The drift check compares parameter checksums across ranks.
"""

import time

import torch

import microddp as mdp
from microddp import monitor
from microddp.dp import wrap


def save_checkpoint(step: int) -> None:
    """Only rank 1 gets here, and it takes its time: meanwhile rank 0 waits in a collective."""
    time.sleep(20)


def hang(world):
    monitor.enable(timeout=3)
    loss = torch.tensor([1.0 + world.rank])
    for step in range(3):
        if step == 2 and world.rank == 1:
            save_checkpoint(step)  # the bug: rank 1 skips this step's all-reduce
            continue
        mdp.comms.all_reduce(loss, "avg")
    return "finished"


def mismatch(world):
    monitor.enable(timeout=10, debug=True)
    grads = torch.ones(4 + world.rank)  # rank 1 built a slightly different model
    mdp.comms.all_reduce(grads)


def drift(world):
    torch.manual_seed(0)
    model = wrap(mdp.FullMLP(8, 2), engine="overlap")  # replicas start equal
    module = model.module
    with torch.no_grad():
        if world.rank == 1:  # a rank-dependent update that DDP never sees
            module.net[2].bias.add_(1e-3)
    monitor.check_replicas(module, step=10)


def run(fn) -> None:
    try:
        mdp.spawn(fn, 2, timeout=60, backend="gloo")
        print("no error")
    except mdp.MicroDDPError as e:  # "rank k failed: MicroDDPError: <report>\nTraceback ..."
        print(str(e).split("MicroDDPError: ", 1)[-1].split("\nTraceback")[0].strip())


def main() -> None:
    print("1. rank 1 skips an all-reduce:")
    run(hang)
    print("\n2. debug mode, ranks pass different shapes:")
    run(mismatch)
    print("\n3. replica drift:")
    run(drift)


if __name__ == "__main__":
    main()
