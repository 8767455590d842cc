"""What every stage of chapter 5 trains: the same model, data, seed and learning rate, so
the stages can be compared number for number (imported by the stage scripts next to it)."""

import argparse

import torch
from torch import nn

import microddp as mdp
from microddp.dp.ladder import shard, toy_data

DIM, DEPTH, GLOBAL_BATCH, STEPS, LR = 32, 16, 48, 5, 0.05
loss_fn = nn.functional.cross_entropy


def fresh_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # every stage, every rank: the same initial weights
    model = mdp.FullMLP(DIM, DEPTH)
    return model, torch.optim.SGD(model.parameters(), lr=LR)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS global batches of GLOBAL_BATCH samples (the same for every stage)."""
    x, y = toy_data(GLOBAL_BATCH * STEPS, DIM, seed=1)
    return list(zip(x.chunk(STEPS), y.chunk(STEPS), strict=True))


def local(world: mdp.World, x: torch.Tensor, y: torch.Tensor):
    """This rank's share of a global batch."""
    return shard(x, world.rank, world.world_size), shard(y, world.rank, world.world_size)


def report(world: mdp.World | None, step: int, loss: float) -> None:
    """Print the loss of the whole global batch (the mean of the ranks' losses), on rank 0."""
    if world is not None and world.distributed:
        t = torch.tensor([loss])
        mdp.comms.all_reduce_mean(t)
        loss = t.item()
    if world is None or world.rank == 0:
        print(f"step {step}  loss {loss:.6f}", flush=True)


def finish(world: mdp.World | None, model: nn.Module) -> None:
    """A fingerprint of the trained parameters: equal fingerprints, equal training."""
    total = sum(p.detach().double().sum().item() for p in model.parameters())
    if world is None or world.rank == 0:
        print(f"parameter checksum {total:.10f}", flush=True)


def parser(description: str, default: int = 2) -> argparse.ArgumentParser:
    """The stage scripts' command line: -n/--world-size, checked by `world_size`."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--world-size", type=int, default=default, help="number of ranks")
    return p


def world_size(p: argparse.ArgumentParser, n: int) -> int:
    """n, if every rank can get an equal share of the global batch; else a one-line error."""
    if n < 1 or GLOBAL_BATCH % n:
        ok = ", ".join(str(k) for k in range(1, GLOBAL_BATCH + 1) if GLOBAL_BATCH % k == 0)
        p.error(f"--world-size {n}: every rank takes an equal share of the global batch of "
                f"{GLOBAL_BATCH}, so the world size must divide it ({ok})")
    return n


def world_size_from_args(description: str, default: int = 2) -> int:
    p = parser(description, default)
    return world_size(p, p.parse_args().world_size)
