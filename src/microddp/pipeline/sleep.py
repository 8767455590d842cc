"""A stage whose compute costs a fixed time: sleep instead of burning a shared core.

On a machine with fewer cores than ranks, real compute makes the ranks fight for the cores, and
a timeline shows the machine's load more than the schedule. A `Sleeping` stage computes its
real outputs (the same numbers) and, on top, sleeps `cost` seconds per block (Linear+ReLU)
forward and twice that backward, split the way zero-bubble splits a backward: half for the
gradient of the stage's input (I), half for the gradient of its weights (W).

The split is made by where the sleeps sit in the autograd graph. One sleep node sits on the
stage's input, so autograd runs it only when the input's gradient is asked for (B and I); the
other hangs from a parameter of its own (a zero scalar, added to the output), so autograd runs
it only when the weights' gradients are asked for (B and W). A full backward runs both.
"""

from __future__ import annotations

import time

import torch
from torch import nn


class _SleepOnInput(torch.autograd.Function):
    """Identity on the stage's input; sleeps `cost` forward and `cost` when its gradient
    is computed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cost: float) -> torch.Tensor:
        ctx.cost = cost
        time.sleep(cost)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.cost)
        return grad, None


class _SleepOnWeights(torch.autograd.Function):
    """Identity on a zero parameter; sleeps `cost` when the weights' gradients are computed."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, cost: float) -> torch.Tensor:
        ctx.cost = cost
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.cost)
        return grad, None


def blocks(stage: nn.Module) -> int:
    """Linear+ReLU blocks in a stage cut from a FullMLP (the head Linear is not a block)."""
    return sum(isinstance(m, nn.ReLU) for m in stage.modules())


class Sleeping(nn.Module):
    """`stage`, costing `cost` seconds per block forward, 2x backward (I and W: `cost` each)."""

    def __init__(self, stage: nn.Module, cost: float) -> None:
        super().__init__()
        self.stage = stage
        self.cost = cost * blocks(stage)
        # Zero, so the output's numbers are the stage's; a parameter, so W's backward finds it.
        self.weight_clock = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The wrapped block's output, after sleeping its fixed forward time."""
        if not x.requires_grad:
            # The first stage's input is the batch: make it a leaf that wants a gradient, so a
            # full backward pays the input half on stage 0 as well (and every stage costs alike).
            x = x.detach().requires_grad_()
        out = self.stage(_SleepOnInput.apply(x, self.cost))
        return out + _SleepOnWeights.apply(self.weight_clock, self.cost)
