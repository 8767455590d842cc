"""What the server and workers train: a model factory, the training data cut into global
batches, and the loss of one worker's shard, scaled so that the workers' average is the mean
over the whole global batch (which is what makes staleness 0 equal one process)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..data import Split, shard_range
from ..errors import MicroDDPError


@dataclass
class Task:
    """`make_model()` must give the same architecture on every rank (the server sends the
    initial values, so only its own call's initialisation matters).

    `batches(clock)`, when given, is the sample indices of global batch number `clock` (the
    training job passes its sampler's, so a run visits the samples one process would, a short
    last batch included); by default every epoch is a fresh seeded permutation cut into whole
    global batches. `make_optimizer(params)` builds the server's optimizer; by default SGD with
    the PSConfig's lr and momentum.
    """

    make_model: Callable[[], nn.Module]
    train: Split
    global_batch: int
    test: Split | None = None
    seed: int = 0
    batches: Callable[[int], torch.Tensor] | None = None
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.global_batch <= len(self.train):
            raise MicroDDPError(f"global batch {self.global_batch} must be between 1 and the "
                                f"{len(self.train)} training samples")

    def batch(self, clock: int) -> torch.Tensor:
        """Sample indices of global batch number `clock`."""
        if self.batches is not None:
            return self.batches(clock)
        per_epoch = len(self.train) // self.global_batch
        epoch, k = divmod(clock, per_epoch)
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(len(self.train), generator=g)[k * self.global_batch:
                                                            (k + 1) * self.global_batch]

    def indices(self, clock: int, part: int = 0, parts: int = 1) -> torch.Tensor:
        """Sample indices of shard `part` of `parts` of global batch number `clock`."""
        batch = self.batch(clock)
        r = shard_range(len(batch), part, parts)
        return batch[r.start:r.stop]

    def shard_loss(self, model: nn.Module, clock: int, part: int = 0,
                   parts: int = 1) -> tuple[torch.Tensor, float, int]:
        """(loss to differentiate, the shard's summed loss, its samples). The first is the
        shard's sum times parts / batch size: the mean over `parts` shards' losses is the
        global batch's mean loss, even when the shards differ in size by one."""
        batch = self.batch(clock)
        r = shard_range(len(batch), part, parts)
        idx = batch[r.start:r.stop]
        total = F.cross_entropy(model(self.train.x[idx]), self.train.y[idx], reduction="sum")
        return total * (parts / len(batch)), float(total.detach()), len(idx)

    def loss(self, model: nn.Module, clock: int, part: int = 0, parts: int = 1) -> torch.Tensor:
        """Only the loss to differentiate of `shard_loss`: the shard's sum times parts / batch."""
        return self.shard_loss(model, clock, part, parts)[0]


@torch.no_grad()
def score(model: nn.Module, split: Split) -> tuple[float, float]:
    """(mean loss, accuracy) over `split`, computed on this rank alone: the server evaluates
    without its workers (data.evaluate is a collective over every rank)."""
    was = model.training
    model.eval()
    logits = model(split.x)
    loss = F.cross_entropy(logits, split.y).item()
    correct = (logits.argmax(dim=1) == split.y).sum().item()
    model.train(was)
    return loss, correct / len(split)


def accuracy(model: nn.Module, split: Split) -> float:
    """Fraction of `split` classified right, computed on this rank alone."""
    return score(model, split)[1]
