"""What the server and workers train: a model factory, the training data cut into global
batches, and the loss of one worker's shard, scaled so that the workers' average is the mean
over the whole global batch (which is what makes staleness 0 equal one process)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..data import Split, shard_range
from ..errors import MicroDDPError


@dataclass
class Task:
    """`make_model()` must give the same architecture on every rank (the server sends the
    initial values, so only its own call's initialisation matters)."""

    make_model: Callable[[], nn.Module]
    train: Split
    global_batch: int
    test: Split | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.global_batch <= len(self.train):
            raise MicroDDPError(f"global batch {self.global_batch} must be between 1 and the "
                                f"{len(self.train)} training samples")

    def indices(self, clock: int, part: int = 0, parts: int = 1) -> torch.Tensor:
        """Sample indices of shard `part` of `parts` of global batch number `clock`; every
        epoch is a fresh permutation (seeded), cut into whole global batches."""
        per_epoch = len(self.train) // self.global_batch
        epoch, k = divmod(clock, per_epoch)
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        batch = torch.randperm(len(self.train), generator=g)[k * self.global_batch:
                                                              (k + 1) * self.global_batch]
        r = shard_range(self.global_batch, part, parts)
        return batch[r.start:r.stop]

    def loss(self, model: nn.Module, clock: int, part: int = 0, parts: int = 1) -> torch.Tensor:
        """Shard loss summed, times parts / global batch: the mean over `parts` shards' losses
        is the global batch's mean loss, even when the shards differ in size by one."""
        idx = self.indices(clock, part, parts)
        logits = model(self.train.x[idx])
        return F.cross_entropy(logits, self.train.y[idx], reduction="sum") * (
            parts / self.global_batch)

    def shard_size(self, part: int, parts: int) -> int:
        """How many samples of a global batch worker `part` of `parts` takes."""
        return len(shard_range(self.global_batch, part, parts))


@torch.no_grad()
def accuracy(model: nn.Module, split: Split) -> float:
    """Fraction of `split` classified right, computed on this rank alone."""
    was = model.training
    model.eval()
    correct = (model(split.x).argmax(dim=1) == split.y).sum().item()
    model.train(was)
    return correct / len(split)
