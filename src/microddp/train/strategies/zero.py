"""`--strategy zero1|zero2|zero3`: data parallelism with the model state sharded by
microddp.zero.Zero (optimizer state; and gradients; and parameters). Every rank writes its own
shard of a checkpoint, which resumes on any world size (train/sharded.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ... import spans
from ...data import Split, evaluate
from ...errors import MicroDDPError
from ...world.world import World
from ...zero import Zero
from .. import sharded
from ..build import Precision, optimizer_class
from ..config import TrainConfig
from .base import Strategy


class Sharded(Strategy):
    """ZeRO-1/2/3: the model under zero.Zero, optimizer state (and gradients, parameters) sharded over ranks."""
    sharded_checkpoints = True

    def __init__(self, cfg: TrainConfig, world: World, module: nn.Module,
                 precision: Precision) -> None:
        super().__init__(cfg, world, module, precision)
        self.stage = int(cfg.strategy.removeprefix("zero"))
        self.name = cfg.strategy
        cls, options = optimizer_class(cfg)
        self.model = Zero(module, cls, stage=self.stage, lr=cfg.learning_rate, **options)
        self.optimizer = self.model.optimizer
        self.data_rank, self.data_size = world.rank, world.world_size

    def step(self) -> None:
        """The optimizer step of this strategy, then gradients cleared."""
        with spans.span("optimizer", track="optim"):
            self.model.step()
            self.model.zero_grad()

    def evaluate(self, split: Split) -> dict:
        """Test loss and accuracy of the whole model, equal on every rank."""
        # Ranks score different test batches, so ZeRO-3 must not gather per forward: the whole
        # module is gathered once for the evaluation (stages 1 and 2 hold it anyway).
        with self.model.gathered() as full:
            return evaluate(full, split, self.world)

    def drift_module(self) -> nn.Module | None:
        """The replica the drift check compares across ranks."""
        return self.module if self.stage < 3 else None  # stage 3 holds no whole replica

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state_dict, for model.pt."""
        return self.model.consolidated_state_dict(to_rank=0)

    def memory(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state on this rank, from the live tensors."""
        return self.model.memory()

    def pieces(self) -> list[sharded.Piece]:
        """This rank's elements of every parameter it steps, as views of its shards."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        plan, shards, rank = self.model.plan, self.model.shards, self.world.rank
        out = []
        for b in plan.buckets:
            for pc in b.pieces:
                if pc.rank != rank:
                    continue
                shard = shards.params[b.index]
                out.append(sharded.Piece(names[id(self.model.sharded[pc.param])], pc.start,
                                         shard.data.narrow(0, pc.offset, pc.length), shard,
                                         pc.offset))
        return out

    def save_shards(self, folder: Path, run: str, common, keep: int) -> None:
        """Write this rank's shard of a checkpoint folder."""
        sharded.save(folder, self.world, run, self.pieces(), self.optimizer, common, keep,
                     self.name)

    def load_shards(self, folder: Path, manifest: dict) -> None:
        """Read this rank's part back from a checkpoint folder of any layout."""
        sharded.load(folder, manifest, self.pieces(), self.optimizer)
        self.model.refresh_from_shards()


def check(cfg: TrainConfig, n: int) -> None:
    """ZeRO brings its own engine, and shards what float16's gradient scaler needs whole (the
    GPT with --tp or --pp: its mesh's checks, ZeRO over the mesh's DP, mesh3d_zero.py)."""
    if _on_mesh(cfg):
        from .mesh3d import check as mesh_check

        return mesh_check(cfg, n)
    if cfg.engine != TrainConfig.engine:
        raise MicroDDPError(f"--engine {cfg.engine} chooses a data-parallel engine, which "
                            f"--strategy {cfg.strategy} replaces with ZeRO's own; drop --engine")
    if cfg.amp == "fp16":
        raise MicroDDPError("--amp fp16 needs a gradient scaler over the whole gradient, "
                            f"which --strategy {cfg.strategy} shards; use --amp bf16")


def make(cfg: TrainConfig, world: World, module: nn.Module, precision: Precision) -> Strategy:
    """This rank's shard of the model state under zero.Zero (stage from the name)."""
    if _on_mesh(cfg):
        from .mesh3d_zero import make as on_mesh

        return on_mesh(cfg, world, module, precision)
    return Sharded(cfg, world, module, precision)


def _on_mesh(cfg: TrainConfig) -> bool:
    return cfg.model == "gpt" and (cfg.tp > 1 or (cfg.pp or 1) > 1)
