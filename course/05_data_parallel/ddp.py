"""Chapter 5, the real thing: microddp.DistributedDataParallel, a drop-in replacement for
PyTorch's. The loop is the one every DDP tutorial shows; swap the class, get the same numbers.
Then the checkpoint habit: save `ddp.module.state_dict()` (no "module." prefix) on rank 0
only, and load that one file on every rank.

    python course/05_data_parallel/ddp.py                   # microddp's DDP, 2 ranks
    python course/05_data_parallel/ddp.py --engine torch    # PyTorch's DDP: same checksum
"""

import os
import tempfile

import problem
import torch
from problem import DEPTH, DIM, batches, finish, fresh_model, local, loss_fn, report

import microddp as mdp


def train(world: mdp.World, engine: str, checkpoint: str) -> None:
    model, opt = fresh_model()
    if engine == "microddp":
        ddp = mdp.DistributedDataParallel(model)
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
    for step, (x, y) in enumerate(batches()):
        xs, ys = local(world, x, y)
        opt.zero_grad()
        loss = loss_fn(ddp(xs), ys)
        loss.backward()  # gradients are averaged over ranks when this returns
        opt.step()
        report(world, step, loss.item())
    finish(world, model)

    if world.rank == 0:  # one writer: every replica is identical anyway
        torch.save(ddp.module.state_dict(), checkpoint)
    mdp.comms.barrier()  # nobody reads before rank 0 has finished writing
    restored = mdp.FullMLP(DIM, DEPTH)
    restored.load_state_dict(torch.load(checkpoint, map_location=world.device))
    same = torch.tensor([int(all(torch.equal(a, b) for a, b in
                                 zip(restored.parameters(), model.parameters(), strict=True)))])
    mdp.comms.all_reduce(same, "min")
    if world.rank == 0:
        first = next(iter(ddp.module.state_dict()))
        print(f"checkpoint: first key {first!r}; reloaded identically on every rank: "
              f"{bool(same.item())}")


def main() -> None:
    p = problem.parser(__doc__)
    p.add_argument("--engine", choices=["microddp", "torch"], default="microddp")
    args = p.parse_args()
    n = problem.world_size(p, args.world_size)
    with tempfile.TemporaryDirectory() as tmp:
        mdp.spawn(train, n, args=(args.engine, os.path.join(tmp, "model.pt")), backend="gloo")


if __name__ == "__main__":
    main()
