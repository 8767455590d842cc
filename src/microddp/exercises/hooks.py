"""Exercise (chapter 5): data parallelism with gradient hooks.

The learner writes `attach_gradient_averaging(model)`: a hook on every parameter that, once
its gradient is ready during backward, replaces it with the average over the ranks. It is run
on 2 and 3 real ranks: every rank feeds the same model different data, and after each of two
backward passes (gradients cleared between them) every gradient must equal the one microddp's
DistributedDataParallel computes for the same model and data, and be the same on every rank.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..dp import DistributedDataParallel
from ..model import FullMLP
from .base import Exercise, Unsolved, call, guarded, load, on_ranks, run_checks

STARTER = '''\
"""Chapter 5 exercise: average the gradients during backward, with hooks.

Check it with:  microddp exercise check hooks attach_gradient_averaging.py
"""

import torch

import microddp as mdp


def attach_gradient_averaging(model: torch.nn.Module) -> None:
    """Register, on every parameter of `model` that requires a gradient, a hook that runs
    when that parameter's gradient is ready during backward and replaces it with the
    average of that gradient over all ranks.

    p.register_post_accumulate_grad_hook(hook) calls hook(p) once p.grad is ready;
    mdp.comms.all_reduce(x, "sum") sums x over the ranks in place (or all_reduce_mean);
    mdp.init().world_size is the number of ranks.
    """
    raise NotImplementedError
'''


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(5, 8, generator=g), torch.randint(0, 3, (5,), generator=g)


@guarded
def _rank(world, path: str) -> str:
    fn = load(path, "attach_gradient_averaging")
    torch.manual_seed(0)
    model = FullMLP(8, depth=2, n_classes=3)
    alone = copy.deepcopy(model)  # the same model without averaging: this rank's own gradient
    ddp = DistributedDataParallel(copy.deepcopy(model))
    call(fn, path, "attach_gradient_averaging", model)
    for step in range(2):
        x, y = _batch(world.rank, step)
        for m in (model, alone, ddp):
            m.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
        for (name, p), a, r in zip(model.named_parameters(), alone.parameters(),
                                   ddp.module.parameters(), strict=True):
            if p.grad is None:
                raise Unsolved(f"after backward {step + 1}, {name} has no gradient")
            if torch.allclose(p.grad, r.grad, rtol=1e-5, atol=1e-6):
                continue
            if torch.allclose(p.grad, a.grad):
                why = "it is this rank's own gradient: did the hook run, and write the " \
                      "average back into p.grad?"
            elif torch.allclose(p.grad, r.grad * world.world_size, rtol=1e-5, atol=1e-6):
                why = f"it is the sum over the ranks: divide by the {world.world_size} ranks"
            elif torch.allclose(p.grad, r.grad * world.world_size ** 2, rtol=1e-5, atol=1e-5):
                why = "it was summed twice: a hook registered twice, or a gradient reduced " \
                      "again after it was averaged"
            else:
                why = f"it differs from the average by up to " \
                      f"{(p.grad - r.grad).abs().max().item():.3g}"
            raise Unsolved(f"after backward {step + 1}, {name}'s gradient is not the average "
                           f"over the ranks: {why}")
    return "ok"


def check(path: str) -> list[str]:
    """What is wrong with the learner's hooks in `path` (nothing: solved)."""
    load(path, "attach_gradient_averaging")

    def cases() -> None:
        for ranks in (2, 3):
            on_ranks(_rank, ranks, (str(path),), "attach_gradient_averaging")
    return run_checks(cases)


EXERCISE = Exercise("hooks", "5", "average gradients during backward with hooks",
                    "attach_gradient_averaging", STARTER, check)
