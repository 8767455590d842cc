"""Exercise (chapter 9): one optimizer step of ZeRO-1.

The learner writes `zero1_step(param, grad, momentum, lr, beta)`: every rank holds the whole
flat parameter and its own (unaveraged) gradient, but the momentum only of its shard; the step
averages the gradients, updates this rank's shard with SGD with momentum, and shares the
updated shards so every rank ends with the whole new parameter. It is run for three steps on
2 and 3 real ranks, with lengths that divide by the ranks and lengths that do not (a rank with
an empty shard included), and compared with plain SGD with momentum over the whole averaged
gradient, which `torch.optim.SGD` computes on each rank from every rank's inputs.
"""

from __future__ import annotations

import torch

from .base import Exercise, Unsolved, call, guarded, load, on_ranks, run_checks

LENGTHS = (8, 10, 1)
STEPS = 3
LR, BETA = 0.5, 0.5
STARTER = '''\
"""Chapter 9 exercise: one step of ZeRO-1 (optimizer state sharded over the ranks).

Check it with:  microddp exercise check zero1 zero1_step.py
"""

import math

import torch

import microddp as mdp


def shard_range(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank `rank`'s elements [start, stop) of a flat vector of n: chunks of ceil(n / world)
    (the last ones shorter, or empty)."""
    size = math.ceil(n / world_size)
    start = min(n, rank * size)
    return start, min(n, start + size)


def zero1_step(param: torch.Tensor, grad: torch.Tensor, momentum: torch.Tensor,
               lr: float, beta: float) -> None:
    """One step of SGD with momentum, ZeRO-1 style, in place.

    param:    the whole flat parameter (n,), the same on every rank
    grad:     this rank's own gradient of it (n,), different on every rank
    momentum: this rank's shard of the momentum (stop - start,), kept between steps
    Average the gradients over the ranks; on this rank's shard only, update
    momentum = beta * momentum + averaged_grad and param -= lr * momentum; then make every
    rank hold every updated shard (mdp.comms.all_reduce, all_gather or broadcast).
    """
    raise NotImplementedError
'''


def _inputs(n: int, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * n + 100 * step + rank)
    return torch.randint(-8, 8, (n,), generator=g).float() / 8


def shard(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """The starter's shard_range: chunks of ceil(n / world_size)."""
    size = -(-n // world_size)
    start = min(n, rank * size)
    return start, min(n, start + size)


@guarded
def _rank(world, path: str) -> str:
    fn = load(path, "zero1_step")
    p = world.world_size
    for n in LENGTHS:
        start, stop = shard(n, world.rank, p)
        param = _inputs(n, -1, 0)  # the same start on every rank
        momentum = torch.zeros(stop - start)
        full = torch.nn.Parameter(param.clone())  # the reference: SGD over the whole vector
        sgd = torch.optim.SGD([full], lr=LR, momentum=BETA, dampening=0)
        for step in range(STEPS):
            grad = _inputs(n, step, world.rank)
            call(fn, path, "zero1_step", param, grad.clone(), momentum, LR, BETA)
            full.grad = sum(_inputs(n, step, r) for r in range(p)) / p
            sgd.step()
            if momentum.shape != (stop - start,):
                raise Unsolved(f"the momentum shard must keep its shape ({stop - start},), "
                               f"it became {tuple(momentum.shape)}")
            diff = (param - full.detach()).abs()
            if diff.max() > 1e-5:
                i = int(diff.argmax())
                owner = next(r for r in range(p) if shard(n, r, p)[0] <= i < shard(n, r, p)[1])
                hint = (f"element {i} is in this rank's shard: check the update and the "
                        "averaging" if owner == world.rank else
                        f"element {i} belongs to rank {owner}'s shard (elements "
                        f"{shard(n, owner, p)[0]}..{shard(n, owner, p)[1] - 1}): did rank "
                        f"{owner} update it and every rank receive it?")
                raise Unsolved(f"after step {step + 1} on a vector of {n}, element {i} is "
                               f"{param[i].item():g}, SGD with momentum over the averaged "
                               f"gradient gives {full[i].item():g}; {hint}")
    return "ok"


def check(path: str) -> list[str]:
    """What is wrong with the learner's ZeRO-1 step in `path` (nothing: solved)."""
    load(path, "zero1_step")

    def cases() -> None:
        for ranks in (2, 3):
            on_ranks(_rank, ranks, (str(path),), "zero1_step")
    return run_checks(cases)


EXERCISE = Exercise("zero1", "9", "one ZeRO-1 optimizer step (sharded momentum)", "zero1_step",
                    STARTER, check)
