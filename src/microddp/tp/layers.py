"""Column- and row-parallel linear layers and the vocabulary-parallel embedding.

A Linear y = x W^T + b with W of shape (out, in) splits two ways:
- column-parallel: W's rows (the output features) are cut in p; each rank computes its slice
  of y from the whole x. Entering costs nothing forward and an all-reduce of x's gradient
  backward (each rank's slice of W contributes a part of it).
- row-parallel: W's columns (the input features) are cut; each rank holds a slice of x and
  computes a partial y that the group sums: an all-reduce forward, nothing backward.
Column then row (the MLP, attention's heads then its output projection) needs no
communication between the two: the column layer's split output is the row layer's split input.

A size that does not divide by p is padded with zero rows or columns up to the next multiple
(`padded`): a padded output feature is zero, contributes zero and gets a zero gradient, so the
numbers are the unpadded model's. Every layer takes its process group: a mesh hands each its
tensor-parallel sub-group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .comm import boundary_calls, enter, leave, rank, size


def padded(n: int, p: int) -> int:
    """n rounded up to a multiple of p."""
    return -(-n // p) * p


def shard(full: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's 1/p of `full` along `dim`, zero-padded to a multiple of p first."""
    p, r = size(group), rank(group)
    extra = padded(full.shape[dim], p) - full.shape[dim]
    if extra:
        pad_shape = list(full.shape)
        pad_shape[dim] = extra
        full = torch.cat([full, full.new_zeros(pad_shape)], dim)
    return full.chunk(p, dim)[r].detach().clone()


class ColumnParallelLinear(nn.Module):
    """Output features split: weight (out_padded / p, in). `enters=False` when the caller has
    entered the region already (attention enters once for q, k and v)."""

    def __init__(self, linear: nn.Linear, group=None, sequence_parallel: bool = False,
                 enters: bool = True) -> None:
        super().__init__()
        self.group, self.sequence_parallel, self.enters = group, sequence_parallel, enters
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(shard(linear.weight, 0, group))
        self.bias = None if linear.bias is None else nn.Parameter(shard(linear.bias, 0, group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's output features of x W^T + b."""
        if self.enters:
            x = enter(x, self.group, self.sequence_parallel)
        return F.linear(x, self.weight, self.bias)

    def comms(self, tokens: int, itemsize: int = 4) -> dict[str, list]:
        """The collectives one forward and one backward issue on `tokens` whole-sequence tokens."""
        if not self.enters or size(self.group) == 1:
            return {"forward": [], "backward": []}
        b = tokens * self.in_features * itemsize
        return {ph: boundary_calls(b, self.sequence_parallel, ph, "enter")
                for ph in ("forward", "backward")}


class RowParallelLinear(nn.Module):
    """Input features split: weight (out, in_padded / p); the bias is whole and added once,
    after the sum (with sequence parallelism each rank adds it to its positions, so its
    gradient is partial: `sequence_parallel_params` lists it for `finish_grads`)."""

    def __init__(self, linear: nn.Linear, group=None, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(shard(linear.weight, 1, group))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T + b summed over the group, from this rank's input features."""
        y = leave(F.linear(x, self.weight), self.group, self.sequence_parallel)
        return y if self.bias is None else y + self.bias

    def comms(self, tokens: int, itemsize: int = 4) -> dict[str, list]:
        """The collectives one forward and one backward issue on `tokens` whole-sequence tokens."""
        if size(self.group) == 1:
            return {"forward": [], "backward": []}
        b = tokens * self.out_features * itemsize
        return {ph: boundary_calls(b, self.sequence_parallel, ph, "leave")
                for ph in ("forward", "backward")}


class VocabParallelEmbedding(nn.Module):
    """Vocabulary rows split: rank r holds rows [r * V_p / p, (r + 1) * V_p / p) of the padded
    table. A token outside a rank's rows looks up zeros there, and the group's sum (an
    all-reduce, or a reduce-scatter along the sequence) gives every token its row."""

    def __init__(self, embedding: nn.Embedding, group=None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.weight = nn.Parameter(shard(embedding.weight, 0, group))
        self.per_rank = self.weight.shape[0]
        self.start = rank(group) * self.per_rank

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Every token's row, from the rank that holds it."""
        local = idx - self.start
        mine = (local >= 0) & (local < self.per_rank)
        out = F.embedding(local.clamp(0, self.per_rank - 1), self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return leave(out, self.group, self.sequence_parallel)

    def comms(self, tokens: int, itemsize: int = 4) -> dict[str, list]:
        """The collectives one forward and one backward issue on `tokens` whole-sequence tokens."""
        if size(self.group) == 1:
            return {"forward": [], "backward": []}
        b = tokens * self.embedding_dim * itemsize
        return {ph: boundary_calls(b, self.sequence_parallel, ph, "leave")
                for ph in ("forward", "backward")}
