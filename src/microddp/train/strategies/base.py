"""What the training loop asks of a strategy: the one interface every `--strategy` implements.

The loop (train/loop.py) owns the data, the order of micro-steps, the loss bookkeeping, the
checkpoint schedule and the report; a strategy owns how the model is spread over the ranks:
which slice of each global batch this rank trains on, one micro-step's forward and backward,
the optimizer step, evaluation, the whole model's state_dict, checkpoints, and the memory it
measured. Every strategy trains to one process's parameters for the same seed and global
batch, because the loop hands it the same scale: the loss of a slice is its *sum* times
`data_size / samples in the step`, and the strategy averages gradients over `data_size`
replicas once per optimizer step.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ... import spans
from ...data import Split
from ...monitor.memory import measure
from ...ps import parse_straggler
from ...timing import straggle_after_forward
from ...world.world import World
from ..build import Precision
from ..config import TrainConfig


class Strategy:
    """One rank's part of a strategy. Subclasses set the attributes below in __init__."""

    name: str = ""
    data_rank: int = 0  # which slice of each global batch this rank trains on
    data_size: int = 1  # into how many slices a global batch is cut (the replicas)
    sharded_checkpoints: bool = False  # True: every rank writes its own part (train/sharded.py)

    def __init__(self, cfg: TrainConfig, world: World, module: nn.Module,
                 precision: Precision) -> None:
        self.cfg, self.world, self.module, self.precision = cfg, world, module, precision
        # --straggler RANK:FACTOR: how many times slower this rank computes (1: not slowed)
        self.slow = parse_straggler(cfg.straggler).get(world.rank, 1.0)

    def describe(self) -> str:
        """The first line's words about how the model is spread over the ranks."""
        return self.name

    def micro_step(self, x: torch.Tensor, y: torch.Tensor, scale: float,
                   sync: bool) -> torch.Tensor | None:
        """Forward and backward of this rank's slice, the loss sum times `scale`; gradients
        are averaged over the replicas when `sync` (the window's last micro-step). Returns the
        slice's summed loss, or None on a rank that computes no loss (a pipeline's inner
        stages), so the loss is counted once per replica.

        This is the data-parallel micro-step (dp and ZeRO share it; a pipeline overrides it):
        `self.model` offers no_sync(), and both passes run inside it when `sync` is False,
        because DDP decides at forward time whether the coming backward averages gradients.
        A rank named by --straggler sleeps after its forward so that its own compute takes
        that factor longer (the backward counted as two forwards: its time includes waiting
        on the other ranks, which is no computing of its own).
        """
        with contextlib.nullcontext() if sync else self.model.no_sync():
            t0 = time.perf_counter()
            with spans.span("forward"), self.precision.autocast():
                logits = self.model(x)
            if self.slow > 1:
                with spans.span("straggle"):
                    straggle_after_forward(time.perf_counter() - t0, self.slow)
            loss_sum = sample_loss_sum(logits, y)
            with spans.span("backward"):
                self.precision.backward(loss_sum * scale)
        return loss_sum

    def step(self) -> None:
        """The optimizer step on the averaged gradients, then drop them. Measured first, with
        the averaged gradients in place and the optimizer state of the last step: the most
        this rank holds at once (`measured()` says over which parameters)."""
        self._memory = {**measure(self.measured(), self.optimizer), "sent_per_step": self._sent}
        self._sent = 0
        with spans.span("optimizer", track="optim"):
            self.precision.step(self.optimizer)
            self.optimizer.zero_grad(set_to_none=True)

    def measured(self) -> nn.Module:
        """The parameters `step` measures this rank's memory over: its module by default."""
        return self.module

    @property
    def lr(self) -> float:
        """The learning rate of the first parameter group (what progress lines log)."""
        return self.optimizer.param_groups[0]["lr"]

    def evaluate(self, split: Split) -> dict:
        """Loss and accuracy of the whole model on `split` (data.evaluate's record)."""
        raise NotImplementedError

    def drift_module(self) -> nn.Module | None:
        """The module whose replicas must stay equal (for --drift-every), or None."""
        return None

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state_dict on rank 0 (None elsewhere): what model.pt holds.
        Every rank must call it: the parts may have to travel to rank 0."""
        raise NotImplementedError

    def replica_state(self) -> dict[str, torch.Tensor] | None:
        """This rank's whole copy of the model's state_dict, if it holds one without any
        communication (a data-parallel replica); None otherwise."""
        return None

    def memory(self) -> dict[str, int]:
        """This rank's bytes of params, grads and optimizer state at the last optimizer step,
        measured from the live tensors, and the bytes it sent in that step."""
        raise NotImplementedError

    # checkpoints: one file from rank 0 (the default), or a folder of shards

    def state_dict(self) -> dict:
        """Model and optimizer state for a one-file checkpoint (sharded_checkpoints False)."""
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict() returned (a one-file checkpoint)."""
        raise NotImplementedError

    def save_shards(self, folder: Path, run: str, common: Callable[[], dict],
                    keep: int) -> None:
        """Write this rank's shard of a sharded checkpoint (sharded_checkpoints True); rank 0
        adds `common()` and the manifest (train/sharded.py). Every rank must call it."""
        raise NotImplementedError

    def load_shards(self, folder: Path, manifest: dict) -> None:
        """Fill this rank's part of the model and optimizer state from a sharded checkpoint
        saved with any layout."""
        raise NotImplementedError


def sample_loss_sum(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The batch's loss summed over its samples. A sequence model's sample is a window: its
    loss is the mean over the window's positions, so the loop's per-sample mean is the
    per-token mean (every window has the same length)."""
    if logits.dim() == 3:
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(),
                               reduction="sum") / y.shape[1]
    return F.cross_entropy(logits.float(), y, reduction="sum")
