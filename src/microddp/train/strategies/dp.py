"""`--strategy dp`: a whole replica of the model on every rank, gradients averaged by the
chosen data-parallel engine (microddp's DDP by default), one checkpoint file from rank 0."""

from __future__ import annotations

import torch
from torch import nn

from ...data import Split, evaluate
from ...world.world import World, distributed
from ..build import Precision, build_optimizer, wrap
from ..config import TrainConfig
from .base import Strategy
from .traffic import ring_all_reduce_bytes


class DataParallel(Strategy):
    """Plain data parallelism: the model under a DDP engine, gradients averaged every step."""
    name = "dp"

    def __init__(self, cfg: TrainConfig, world: World, module: nn.Module,
                 precision: Precision) -> None:
        super().__init__(cfg, world, module, precision)
        self.model = wrap(module, cfg.engine, world)
        self.optimizer = build_optimizer(cfg, self.model.parameters())
        self.data_rank, self.data_size = world.rank, world.world_size
        self._memory: dict[str, int] = {}
        self._sent = 0

    def describe(self) -> str:
        """How this strategy is set up, for the run's first lines."""
        return f"dp, engine {self.cfg.engine if distributed() else 'none'}"

    def micro_step(self, x: torch.Tensor, y: torch.Tensor, scale: float,
                   sync: bool) -> torch.Tensor:
        """The data-parallel micro-step (Strategy's), counting the bytes a sync sends."""
        loss_sum = super().micro_step(x, y, scale, sync)
        if sync:
            self._sent += ring_all_reduce_bytes(self.module, self.world.world_size)
        return loss_sum

    def evaluate(self, split: Split) -> dict:
        """Test loss and accuracy of the whole model, equal on every rank."""
        return evaluate(self.module, split, self.world)

    def drift_module(self) -> nn.Module:
        """The replica the drift check compares across ranks."""
        return self.module

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state_dict, for model.pt."""
        return self.module.state_dict() if self.world.rank == 0 else None

    def replica_state(self) -> dict[str, torch.Tensor]:
        """This rank's whole replica, for the one-file checkpoint."""
        return self.module.state_dict()

    def memory(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state on this rank, from the live tensors."""
        return dict(self._memory)

    def state_dict(self) -> dict:
        """Model and optimizer state for a one-file checkpoint."""
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict() returned (a one-file checkpoint)."""
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


def check(cfg: TrainConfig, n: int) -> None:
    """Nothing of its own to check (dp takes every setting the synchronous loop takes), but
    the GPT's --tp / --pp mesh's."""
    if cfg.model == "gpt" and cfg.cp > 1:
        from .context import check as context_check

        context_check(cfg, n)
    elif _on_mesh(cfg):
        from .mesh3d import check as mesh_check

        mesh_check(cfg, n)


def _on_mesh(cfg: TrainConfig) -> bool:
    return cfg.model == "gpt" and (cfg.tp > 1 or (cfg.pp or 1) > 1)


def make(cfg: TrainConfig, world: World, module: nn.Module, precision: Precision) -> Strategy:
    """This rank's replica under the chosen engine (the GPT with --tp or --pp: its share of
    a dp x pp x tp mesh; with --cp: a dp x cp x tp mesh)."""
    if cfg.model == "gpt" and cfg.cp > 1:
        from .context import make as on_context

        return on_context(cfg, world, module, precision)
    if _on_mesh(cfg):
        from .mesh3d import make as on_mesh

        return on_mesh(cfg, world, module, precision)
    return DataParallel(cfg, world, module, precision)
