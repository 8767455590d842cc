"""`loss.backward(create_graph=True)` through DDP (gradient penalties, MAML, Hessian-vector
products): gradients that carry their own autograd graph.

What PyTorch's DDP does, and so what this does: the gradients are averaged over ranks as
usual, but the graph behind each averaged `.grad` is this rank's own gradient divided by the
world size. Backpropagating through `.grad` does not go through the all-reduce (the other
ranks' gradients are constants), and the higher-order gradients that a second backward
produces are not averaged. The bucket copies run without autograd (an `out=` copy cannot be
differentiated); the graph is kept beside them and attached to the average at the end.
"""

from __future__ import annotations

import warnings

import torch

DOUBLE_BACKWARD_WARNING = (
    "backward(create_graph=True) through DistributedDataParallel is only partly supported, "
    "as in PyTorch: gradients are averaged over ranks, but higher-order gradients are not, "
    "and backpropagation through .grad does not go through the all-reduce (each rank's graph "
    "sees its own gradient divided by the world size). Compute a gradient penalty with "
    "torch.autograd.grad(..., create_graph=True) on inputs, which DDP handles fully")


class _Averaged(torch.autograd.Function):
    """The average's values, with the gradient flowing to this rank's scaled gradient (as
    torch's copy of the bucket into `.grad` does, the all-reduce being invisible to autograd)."""

    @staticmethod
    def forward(ctx, scaled: torch.Tensor, average: torch.Tensor) -> torch.Tensor:
        return average.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class DoubleBackward:
    """Reducer mixin: a hook under create_graph=True (autograd runs hooks with grad mode on)."""

    graphs: dict[int, torch.Tensor]

    def _on_graph_grad(self, i: int) -> None:
        grad = self.params[i].grad
        if self.expect and grad is not None and grad.requires_grad:
            if not self.graphs:
                warnings.warn(DOUBLE_BACKWARD_WARNING, UserWarning, stacklevel=2)
            # torch's own arithmetic for the graph: multiply by 1/world_size
            self.graphs[i] = torch.mul(grad, 1.0 / self.div_factor)
        with torch.no_grad():
            self._on_grad(i)

    def _end_of_backward(self) -> None:
        """The end-of-backward callback: average, then give each graph its averaged value."""
        if not self.graphs:
            self._finish()
            return
        with torch.no_grad():
            self._finish()  # calls _drop_graph_grads before writing the averages
        graphs, self.graphs = self.graphs, {}
        with torch.enable_grad():
            for i, scaled in graphs.items():
                p = self.params[i]
                if p.grad is not None:
                    p.grad = _Averaged.apply(scaled, p.grad)

    def _drop_graph_grads(self) -> None:
        """The averages go into a fresh .grad, not over a tensor that other graphs may hold."""
        for i in self.graphs:
            self.params[i].grad = None
