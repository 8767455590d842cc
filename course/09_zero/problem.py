"""What every script of chapter 9 trains and measures: one model, data, seed and optimizer
(Adam, fp32), trained with plain data parallelism or a ZeRO stage, so the stages can be
compared byte for byte and number for number (imported by the scripts next to it)."""

import argparse

import torch
from torch import nn

import microddp as mdp
from microddp import zero

DIM, DEPTH, GLOBAL_BATCH, STEPS, LR = 128, 4, 48, 3, 1e-3
loss_fn = nn.functional.cross_entropy
NAMES = {0: "plain DP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


def fresh_model(dim: int = DIM) -> nn.Module:
    torch.manual_seed(0)  # every strategy, every rank: the same initial weights
    return mdp.FullMLP(dim, DEPTH)


def batches(dim: int = DIM) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS global batches of GLOBAL_BATCH samples; the label is a side of a hyperplane."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(GLOBAL_BATCH * STEPS, dim, generator=g)
    y = (x @ torch.randn(dim, generator=g) > 0).long()
    return list(zip(x.chunk(STEPS), y.chunk(STEPS), strict=True))


def local(world: mdp.World, t: torch.Tensor) -> torch.Tensor:
    """This rank's equal share of a global batch."""
    share = len(t) // world.world_size
    return t[world.rank * share:(world.rank + 1) * share]


def flat(model: nn.Module) -> torch.Tensor:
    """All the parameters in one vector, to compare two trainings element by element."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def checksum(params: torch.Tensor) -> float:
    return params.double().sum().item()


def same(a: torch.Tensor, b: torch.Tensor) -> str:
    """The largest difference between two trainings' parameters, and whether it is float
    rounding (sums taken in another order, then amplified a little by Adam)."""
    diff = (a - b).abs().max().item()
    return f"{diff:.1e} {diff <= 1e-5}"


def train(world: mdp.World, stage: int, dim: int = DIM) -> tuple[dict[str, int], torch.Tensor]:
    """Train with plain DP (stage 0) or ZeRO `stage`; return this rank's memory, measured at
    the last optimizer step, and the trained parameters (one vector)."""
    model = fresh_model(dim)
    if stage == 0:
        ddp = mdp.DDP(model)
        sent = zero.CountingAllReduce()  # counts what DP's all-reduce sends
        ddp.register_comm_hook(None, sent)
        opt = torch.optim.Adam(ddp.parameters(), lr=LR)
        for x, y in batches(dim):
            loss_fn(ddp(local(world, x)), local(world, y)).backward()
            memory = zero.measure(model, opt)  # gradients ready, Adam's state from last step
            opt.step()
            opt.zero_grad()
            sent.end_step()
        return {**memory, "sent_per_step": sent.last_step}, flat(model)
    z = zero.Zero(model, torch.optim.Adam, stage=stage, lr=LR)
    for x, y in batches(dim):
        loss_fn(z(local(world, x)), local(world, y)).backward()
        z.step()
        z.zero_grad()
    with z.gathered() as full:
        return z.memory(), flat(full)


def kib(n: int) -> str:
    return f"{n / 1024:9.1f} KiB"


HEADER = (f"{'strategy':<10}{'params':>14}{'grads':>14}{'optimizer':>14}{'total':>14}"
          f"{'sent/step':>14}  max |diff| vs DP, within rounding")


def row(name: str, m: dict[str, int], same: str) -> str:
    total = m["params"] + m["grads"] + m["optimizer_state"]
    return (f"{name:<10}{kib(m['params']):>14}{kib(m['grads']):>14}"
            f"{kib(m['optimizer_state']):>14}{kib(total):>14}{kib(m['sent_per_step']):>14}  {same}")


def world_size_from_args(description: str, default: int = 2) -> int:
    """-n/--world-size, checked: every rank takes an equal share of the global batch."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--world-size", type=int, default=default, help="number of ranks")
    n = p.parse_args().world_size
    if n < 1 or GLOBAL_BATCH % n:
        ok = ", ".join(str(k) for k in range(1, GLOBAL_BATCH + 1) if GLOBAL_BATCH % k == 0)
        p.error(f"--world-size {n}: every rank takes an equal share of the global batch of "
                f"{GLOBAL_BATCH}, so the world size must divide it ({ok})")
    return n


def against_dp(world: mdp.World, stage: int) -> None:
    """Train plain DP and ZeRO-`stage` from the same start; print both rows and checksums."""
    dp, dp_params = train(world, stage=0)
    mine, my_params = train(world, stage=stage)
    if world.rank == 0:
        print(f"rank 0 of {world.world_size}, Adam, fp32, measured at the optimizer step")
        print(HEADER)
        print(row(NAMES[0], dp, "-"))
        print(row(NAMES[stage], mine, same(my_params, dp_params)))
        print(f"parameter checksum {checksum(my_params):.10f} "
              f"(plain DP: {checksum(dp_params):.10f})")
