"""The model every chapter trains: a deep stack of Linear+ReLU layers, replicated on each rank.

Deep and narrow on purpose: many parameter tensors whose gradients become ready one after the
other during backward, which is exactly what hooks, buckets and overlap exploit.
"""

from __future__ import annotations

import torch
from torch import nn

from .errors import MicroDDPError


class FullMLP(nn.Module):
    """`depth` Linear+ReLU layers of width `dim`, then a Linear to `n_classes` logits."""

    def __init__(self, dim: int, depth: int = 16, n_classes: int = 2,
                 in_features: int | None = None) -> None:
        super().__init__()
        in_features = dim if in_features is None else in_features
        for name, value in (("dim", dim), ("n_classes", n_classes), ("in_features", in_features)):
            if not isinstance(value, int) or value < 1:
                raise MicroDDPError(f"FullMLP {name} must be a positive whole number, got {value!r}")
        if not isinstance(depth, int) or depth < 0:
            raise MicroDDPError(f"FullMLP depth must be a whole number >= 0, got {depth!r}")
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, dim), nn.ReLU()]
            width = dim
        layers.append(nn.Linear(width, n_classes))
        self.net = nn.Sequential(*layers)
        self.dim, self.depth, self.n_classes, self.in_features = dim, depth, n_classes, in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The logits for a batch `x` of shape (batch, dim)."""
        return self.net(x)
