"""`--model gpt --tp T` (under --strategy dp): tensor parallelism inside data parallelism.

The world's n ranks form a mesh of n / T data-parallel replicas of T tensor-parallel ranks,
TP innermost: replica d is ranks d*T .. d*T+T-1 (neighbours, one host: TP's all-reduces run
in every layer, data parallelism's once a step), and tensor rank t's data-parallel group is
ranks t, t+T, ... Both kinds of sub-group are made once, here, by every rank in one order.

Each rank holds its share of the GPT (tp.TensorParallelGPT, built from the same seeded whole
model, so the mesh starts where one process starts); a replica's T ranks read the same slice
of each global batch; after the window's backward the gradients of every shard are averaged
over its data-parallel group. The loss is counted by tensor rank 0 only, once per replica.
Evaluation and model.pt use the whole model gathered from the shards. Checkpoints are one file
per rank (its shard and its optimizer state); resuming them is not built yet (refused).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from ... import checkpoint, comms, spans
from ...data import Split, evaluate
from ...monitor.memory import measure
from ...timing import straggle_after_forward
from ...tp import TensorParallelGPT
from ...world.world import World
from ..build import Precision, build_optimizer
from ..config import TrainConfig
from .base import Strategy


def mesh_groups(world_size: int, tp: int, rank: int):
    """(tensor-parallel group, data-parallel group) of `rank`; every rank makes every group."""
    dp = world_size // tp
    tp_groups = [comms.new_group(list(range(d * tp, (d + 1) * tp))) for d in range(dp)]
    dp_groups = [comms.new_group(list(range(t, world_size, tp))) for t in range(tp)]
    return tp_groups[rank // tp], dp_groups[rank % tp]


class TensorParallel(Strategy):
    """This rank's tensor-parallel share of the GPT, averaged over its data-parallel group."""
    name = "dp-tp"
    sharded_checkpoints = True  # every rank holds a different shard

    def __init__(self, cfg: TrainConfig, world: World, module: nn.Module,
                 precision: Precision) -> None:
        super().__init__(cfg, world, module, precision)
        self.tp = cfg.tp
        self.dp = world.world_size // cfg.tp
        self.tp_group, self.dp_group = mesh_groups(world.world_size, cfg.tp, world.rank)
        self.model = TensorParallelGPT(module, self.tp_group)
        self.optimizer = build_optimizer(cfg, self.model.parameters())
        self.data_rank, self.data_size = world.rank // cfg.tp, self.dp
        self.counts_loss = world.rank % cfg.tp == 0
        self._memory: dict[str, int] = {}

    def describe(self) -> str:
        """How this strategy is set up, for the run's first lines."""
        return f"dp x tp = {self.dp} x {self.tp} (tp innermost)"

    def micro_step(self, x: torch.Tensor, y: torch.Tensor, scale: float,
                   sync: bool) -> torch.Tensor | None:
        """Forward and backward of the replica's slice through this rank's shards; the loss
        sum is the per-window mean loss summed over windows (as sample_loss_sum)."""
        loss_sum = torch.zeros((), device=x.device)
        if len(y):  # a replica's T ranks share the slice: all skip an empty one together
            t0 = time.perf_counter()
            with spans.span("forward"):
                loss_sum = self.model.loss(x, y) * len(y)
            if self.slow > 1:
                straggle_after_forward(time.perf_counter() - t0, self.slow)
            with spans.span("backward"):
                self.precision.backward(loss_sum * scale)
        if sync:
            self.model.finish_grads()
            self._average()
        return loss_sum.detach() if self.counts_loss else None

    def _average(self) -> None:
        """Average every shard's gradient over the data-parallel group, in one flat message."""
        params = list(self.model.parameters())
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.dp == 1:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        with spans.span("all_reduce", track="comm"):
            comms.all_reduce(flat, "sum", self.dp_group)
        flat /= self.dp
        for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p.grad.copy_(g.view_as(p))

    def step(self) -> None:
        """The optimizer step on this rank's shards, then gradients cleared."""
        self._memory = measure(self.model, self.optimizer)
        with spans.span("optimizer", track="optim"):
            self.precision.step(self.optimizer)
            self.optimizer.zero_grad(set_to_none=True)

    @property
    def lr(self) -> float:
        """The learning rate of the first parameter group (what progress lines log)."""
        return self.optimizer.param_groups[0]["lr"]

    def evaluate(self, split: Split) -> dict:
        """Validation loss and accuracy of the whole model, gathered from the shards."""
        self.module.load_state_dict(self.model.full_state_dict())
        return evaluate(self.module, split, self.world)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole GPT's state_dict on rank 0 (every rank takes part in the gathers)."""
        full = self.model.full_state_dict()
        return full if self.world.rank == 0 else None

    def memory(self) -> dict[str, int]:
        """Bytes of this rank's shards, their gradients and optimizer state."""
        return dict(self._memory)

    def save_shards(self, folder: Path, run: str, common, keep: int) -> None:
        """This rank's shard and optimizer state in its own file; rank 0 adds the common state."""
        folder.mkdir(parents=True, exist_ok=True)
        checkpoint.write_atomic({"run": run, "rank": self.world.rank, "tp": self.tp,
                                 "model": self.model.state_dict(),
                                 "optimizer": self.optimizer.state_dict()},
                                folder / f"tp-rank{self.world.rank:05d}.pt")
        if self.world.rank == 0:
            checkpoint.write_atomic({**common(), "run": run}, folder / "common.pt")
        comms.barrier()

    def load_shards(self, folder: Path, manifest: dict) -> None:
        """Not built: validate refuses --resume with --tp before anything runs."""
        raise NotImplementedError("resuming a --tp run")


def make(cfg: TrainConfig, world: World, module: nn.Module, precision: Precision) -> Strategy:
    """This rank's tensor-parallel share of the GPT."""
    return TensorParallel(cfg, world, module, precision)
