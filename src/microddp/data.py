"""Data for the training job: bundled real data, synthetic data, sharding and exact evaluation.

Sharding is planned per *global* batch: every epoch is one permutation of the whole training
set, cut into global batches, and each rank takes a contiguous slice of each. So the samples
in a step do not depend on the world size, shuffling changes every epoch without `set_epoch`,
and an uneven last batch is split as evenly as it goes instead of padded with duplicates.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .errors import MicroDDPError
from .world.world import World

DATASETS = ("digits", "synthetic")
# The test split must not move when the user changes --seed: one fixed split for every run.
SPLIT_SEED = 0


@dataclass
class Split:
    """Inputs and integer labels of one split, already tensors (these data sets fit in memory)."""

    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return len(self.y)

    def to(self, device: torch.device | str) -> Split:
        """The same samples on `device`."""
        return Split(self.x.to(device), self.y.to(device))


@dataclass
class Dataset:
    """A classification data set split into train and test, with the sizes a model needs."""
    name: str
    train: Split
    test: Split
    in_features: int
    n_classes: int


def _split(x: torch.Tensor, y: torch.Tensor, test_fraction: float) -> tuple[Split, Split]:
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_test = int(round(len(y) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return Split(x[train], y[train]), Split(x[test], y[test])


def _digits_arrays():
    """(pixels, labels) of scikit-learn's bundled digits file.

    Read straight from the file the package ships: importing sklearn.datasets pulls in SciPy
    and costs seconds on every rank, far longer than the whole training run.
    """
    import importlib.util

    import numpy as np

    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise MicroDDPError("the digits data set needs scikit-learn: "
                            "pip install 'microddp[train]' (or use --dataset synthetic)")
    for root in spec.submodule_search_locations or []:
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            table = np.loadtxt(path, delimiter=",", dtype=np.float32)
            return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits  # a layout we do not know: the slow, sure way

    return load_digits(return_X_y=True)


def digits() -> Dataset:
    """scikit-learn's handwritten digits (1797 8x8 images, 10 classes): real data, offline."""
    x, y = _digits_arrays()
    # Pixels are 0..16; centred to [-1, 1] so plain SGD trains well without extra care.
    x = torch.as_tensor(x, dtype=torch.float32) / 8.0 - 1.0
    train, test = _split(x, torch.as_tensor(y, dtype=torch.int64), 0.2)
    return Dataset("digits", train, test, in_features=64, n_classes=10)


def synthetic(n: int = 2560, in_features: int = 64, n_classes: int = 10) -> Dataset:
    """Gaussian clusters around random centres: learnable, any size, no dependency."""
    g = torch.Generator().manual_seed(SPLIT_SEED)
    centres = torch.randn(n_classes, in_features, generator=g) * 0.4
    y = torch.randint(0, n_classes, (n,), generator=g)
    x = centres[y] + torch.randn(n, in_features, generator=g)
    train, test = _split(x, y, 0.2)
    return Dataset("synthetic", train, test, in_features, n_classes)


def load_dataset(name: str) -> Dataset:
    """The data set called `name` (one of DATASETS)."""
    if name == "digits":
        return digits()
    if name == "synthetic":
        return synthetic()
    raise MicroDDPError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")


class ShardedBatchSampler:
    """This rank's share of each global batch, reshuffled every epoch on its own.

    Iterating yields lists of sample indices (usable as a DataLoader `batch_sampler`). Each
    `__iter__` continues where the last one stopped and then moves to the next epoch, so a plain
    `for epoch ...: for batch in sampler` loop sees a new order every epoch with no `set_epoch`.
    `state_dict()` records (epoch, position) so a resumed run picks up at the very next batch.

    Empty batches: a last global batch smaller than the world size would leave some ranks
    nothing, which a DataLoader cannot collate and whose mean loss is NaN, so it is refused
    unless `allow_empty=True` (for a loop that sums its loss, as `microddp train` does: an
    empty batch adds zero, and its rank still joins the step's all-reduce).

    Prefetching: a DataLoader with `num_workers > 0` draws batches ahead of the loop, so the
    sampler's own place is ahead of what was trained; save `state_dict(consumed=k)`, k being
    the batches the loop took from the current iterator.
    """

    def __init__(self, n: int, global_batch_size: int, rank: int = 0, world_size: int = 1, *,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 allow_empty: bool = False) -> None:
        if n < 1:
            raise MicroDDPError(f"cannot sample from an empty data set (n={n})")
        if global_batch_size < 1:
            raise MicroDDPError(f"batch size must be at least 1, got {global_batch_size}")
        if not 0 <= rank < world_size:
            raise MicroDDPError(f"rank {rank} is outside the world of size {world_size}")
        if drop_last and n < global_batch_size:
            raise MicroDDPError(f"drop_last with {n} samples and batch size {global_batch_size} "
                                "leaves no batch at all; lower the batch size")
        self.n, self.batch_size, self.rank, self.world_size = n, global_batch_size, rank, world_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        if not allow_empty:  # every rank checks, so all of them stop, not only the empty ones
            self._refuse_empty_batches()
        self.epoch, self.position = 0, 0  # where the next batch comes from
        self._started = (0, 0)  # where the latest iterator began: what `consumed` counts from
        self._restored = False  # load_state_dict() just ran: set_epoch() must not undo it

    def _refuse_empty_batches(self) -> None:
        n, size, ranks = self.n, self.batch_size, self.world_size
        what = ("some ranks would get an empty batch, which a DataLoader cannot collate (and "
                "whose mean loss is NaN)")
        escape = "or allow_empty=True if your loop handles empty batches"
        if n < ranks:
            raise MicroDDPError(f"{n} sample(s) for {ranks} ranks: {what}; use fewer ranks, "
                                f"{escape}")
        if size < ranks:
            raise MicroDDPError(f"a global batch of {size} sample(s) over {ranks} ranks: "
                                f"{what}; use a batch size of at least {ranks}, {escape}")
        rest = n % size
        if rest and n > size and not self.drop_last and rest < ranks:
            raise MicroDDPError(f"the last global batch holds {rest} sample(s) ({n} samples in "
                                f"batches of {size}), fewer than the {ranks} ranks: {what}; "
                                f"pass drop_last=True, choose a batch size that leaves at least "
                                f"{ranks} in the last batch, {escape}")

    def __len__(self) -> int:
        """Batches per epoch (the same on every rank, so collectives stay in step)."""
        full, rest = divmod(self.n, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def order(self, epoch: int) -> torch.Tensor:
        """The whole epoch's sample order: a fixed function of (seed, epoch), as on every rank."""
        if not self.shuffle:
            return torch.arange(self.n)
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch))

    def global_batches(self, epoch: int) -> list[torch.Tensor]:
        """Every rank's indices of each batch of `epoch`, before sharding."""
        return list(torch.split(self.order(epoch), self.batch_size))[: len(self)]

    def global_sizes(self, epoch: int) -> list[int]:
        """The size of every global batch of `epoch`, in order."""
        return [len(b) for b in self.global_batches(epoch)]

    def shard(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous slice; sizes differ by at most one, never padded."""
        return torch.tensor_split(batch, self.world_size)[self.rank]

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its first batch (what torch's DistributedSampler needs each epoch).

        Right after `load_state_dict`, the restored epoch keeps its restored place: torch's
        habit of calling set_epoch at the top of every epoch must not undo a resume.
        """
        if not (self._restored and epoch == self.epoch):
            self.epoch, self.position = epoch, 0
        self._restored = False
        self._started = (self.epoch, self.position)

    def __iter__(self) -> Iterator[list[int]]:
        # Not a generator function: the place is taken at iter(), before the first batch, so
        # `state_dict(consumed=0)` on a fresh iterator already means this epoch.
        epoch, start = self.epoch, self.position
        if start >= len(self):  # the last epoch was finished: begin the next one
            epoch, start = epoch + 1, 0
        self._started, self._restored = (epoch, start), False
        return self._batches(epoch, start)

    def _batches(self, epoch: int, start: int) -> Iterator[list[int]]:
        batches = self.global_batches(epoch)
        for i in range(start, len(batches)):
            self.epoch, self.position = epoch, i + 1
            yield self.shard(batches[i]).tolist()
        self.epoch, self.position = epoch + 1, 0

    def state_dict(self, consumed: int | None = None) -> dict:
        """Where the next batch comes from, for `load_state_dict`.

        `consumed`: the batches the loop has taken from the latest iterator. Needed under a
        DataLoader with `num_workers > 0`, whose workers draw batches ahead of the loop, so
        the sampler's own place is not yet the next batch the loop will train on.
        """
        epoch, position = self.epoch, self.position
        if consumed is not None:
            epoch, start = self._started
            if not 0 <= consumed <= len(self) - start:
                raise MicroDDPError(
                    f"consumed={consumed}, but the latest iterator began at batch {start} of "
                    f"{len(self)}, so it holds {len(self) - start}: count only the batches "
                    "taken from this epoch's iterator")
            position = start + consumed
        return {"epoch": epoch, "position": position, "seed": self.seed,
                "n": self.n, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position; refuses a state saved for another data set size or
        batch size."""
        if (state["n"], state["batch_size"]) != (self.n, self.batch_size):
            raise MicroDDPError(
                f"sampler state is for {state['n']} samples in batches of {state['batch_size']}, "
                f"not {self.n} in batches of {self.batch_size}; use the original --batch-size")
        self.epoch, self.position, self.seed = state["epoch"], state["position"], state["seed"]
        self._started, self._restored = (self.epoch, self.position), True


def shard_range(n: int, rank: int, world_size: int) -> range:
    """Contiguous, disjoint, covering: rank r's part of n items (sizes differ by at most 1)."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


@torch.no_grad()
def evaluate(module: nn.Module, split: Split, world: World | None = None,
             batch_size: int = 1024) -> dict:
    """Loss and accuracy over the whole split, each sample counted exactly once.

    The split is cut into the same micro-batches whatever the world size (samples
    [0, batch_size), [batch_size, 2 * batch_size), ...) and each rank scores a contiguous run of
    whole micro-batches. A float32 matmul rounds a row differently in a batch of another shape,
    so scoring each sample in the same batch on any world size, and adding the per-batch sums in
    one fixed order, gives the world size no way to change the result: it is a single process's
    bit for bit, when both use the same number of intra-op threads (how a batch is split among
    threads changes the rounding too, by a few units in the last place).
    """
    from . import comms

    world = world or comms.get_world()
    if batch_size < 1:
        raise MicroDDPError(f"evaluation batch size must be at least 1, got {batch_size}")
    n_batches = -(-len(split) // batch_size)
    mine = shard_range(n_batches, world.rank, world.world_size)
    was_training = module.training
    module.eval()
    device = next(module.parameters()).device
    # One loss sum per micro-batch, zero for the others' batches: the all_reduce then adds
    # exact zeros, and every rank adds the sums in batch order, as a single process does.
    loss_sums = torch.zeros(n_batches, dtype=torch.float64, device=device)
    counts = torch.zeros(2, dtype=torch.float64, device=device)  # correct, count: integers
    for b in mine:
        lo, hi = b * batch_size, min((b + 1) * batch_size, len(split))
        x, y = split.x[lo:hi].to(device), split.y[lo:hi].to(device)
        logits = module(x).float()
        loss_sums[b] = F.cross_entropy(logits, y, reduction="none").double().sum()
        counts[0] += (logits.argmax(dim=1) == y).sum()
        counts[1] += hi - lo
    module.train(was_training)
    totals = torch.cat([loss_sums, counts])
    comms.all_reduce(totals, "sum")
    loss_sum = sum(totals[:n_batches].tolist())  # in batch order, on every world size
    correct, count = totals[n_batches:].tolist()
    return {"loss": loss_sum / count, "accuracy": correct / count,
            "correct": int(correct), "count": int(count)}
