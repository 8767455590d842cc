"""`--strategy zero1|zero2 --model gpt --tp T --pp P`: the mesh of mesh3d.py with ZeRO over its
data-parallel dimension.

Each rank's stage shards (its parameters, in stage order) are one flat vector of n elements.
The rank's DP group cuts it into dp equal pieces, padded at the end; replica d owns piece d: the
optimizer steps only that piece (a flat fp32 parameter of n / dp elements), so the optimizer
state per rank is 1/dp of the mesh's. After the window's backward the gradients are
all-reduced (ZeRO-1: every rank keeps the whole averaged gradient) or reduce-scattered
(ZeRO-2: each rank keeps only its piece's, and lets the rest go); after the step, an
all-gather over the DP group brings every rank's stage shards up to date. The optimizers
microddp trains with (SGD with momentum, Adam) act element by element, so stepping a piece is
stepping those elements of the whole: the mesh still lands on one process's parameters.
ZeRO-3 (parameters gathered per layer) on a mesh is not built.

Checkpoints: every replica writes the runs of elements its piece owns, with their optimizer
state (a replicated parameter from tensor rank 0 only); a resume on any mesh, with or without
ZeRO, reads them as mesh3d.py's pieces.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ... import comms, spans
from ...monitor.memory import measure
from ...world.world import World
from .. import sharded
from ..build import Precision, build_optimizer
from ..config import TrainConfig
from .mesh3d import Mesh3DParallel


class _StateOnly:
    """Where a load of parameter values puts optimizer state it does not want."""

    def __init__(self) -> None:
        self.state: dict = {}


class Mesh3DZero(Mesh3DParallel):
    """The mesh with the optimizer state (ZeRO-1) and gradients (ZeRO-2) sharded over DP."""

    def __init__(self, cfg: TrainConfig, world: World, module: nn.Module,
                 precision: Precision) -> None:
        super().__init__(cfg, world, module, precision)
        self.zero = int(cfg.strategy.removeprefix("zero"))
        self.params = list(self.stage.parameters())
        self.base, at = {}, 0
        for p in self.params:
            self.base[id(p)] = at
            at += p.numel()
        self.n, dp = at, self.mesh.dp
        self.per = -(-self.n // dp)
        self.lo = self.groups.replica * self.per
        self.hi = min(self.n, self.lo + self.per)
        self.master = nn.Parameter(self._flat_params()[self.lo:self.hi].clone())
        self.optimizer = build_optimizer(cfg, [self.master])

    def describe(self) -> str:
        """How this strategy is set up, for the run's first lines."""
        return (super().describe() + f"; ZeRO-{self.zero} over dp: this rank steps elements "
                f"{self.lo}..{self.hi} of its {self.n}")

    def _flat_params(self) -> torch.Tensor:
        return torch.cat([p.data.reshape(-1) for p in self.params])

    def _padded(self, flat: torch.Tensor) -> torch.Tensor:
        extra = self.per * self.mesh.dp - flat.numel()
        return torch.cat([flat, flat.new_zeros(extra)]) if extra else flat

    def _average(self) -> None:
        """The averaged gradient of this rank's piece, into the flat parameter's .grad."""
        flat = torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1)
                          for p in self.params])
        dp, size = self.mesh.dp, self.hi - self.lo
        if dp == 1:
            self.master.grad = flat.clone()
            return
        flat = self._padded(flat)
        with spans.span("all_reduce" if self.zero == 1 else "reduce_scatter", track="comm"):
            if self.zero == 1:  # every rank keeps the whole averaged gradient
                comms.all_reduce(flat, "sum", self.groups.dp_group)
                flat /= dp
                for p, g in zip(self.params, flat[:self.n].split([q.numel() for q in self.params]),
                                strict=True):
                    p.grad = g.view_as(p).clone()
                mine = flat[self.lo:self.lo + size].clone()
                self._sent += 2 * flat.nbytes * (dp - 1) // dp
            else:  # each rank keeps its piece's only
                mine = torch.empty(self.per, dtype=flat.dtype)
                comms.reduce_scatter(mine, list(flat.split(self.per)), "sum",
                                     self.groups.dp_group)
                mine = mine[:size] / dp
                for p in self.params:
                    p.grad = None
                self._sent += flat.nbytes * (dp - 1) // dp
        self.master.grad = mine

    def step(self) -> None:
        """Step this rank's piece, then all-gather the pieces into the stage's parameters."""
        self._memory = {**measure([*self.params, self.master], self.optimizer),
                        "sent_per_step": self._sent}
        self._sent = 0
        with spans.span("optimizer", track="optim"):
            self.precision.step(self.optimizer)
            self.optimizer.zero_grad(set_to_none=True)
        for p in self.params:
            p.grad = None
        self._scatter_back()

    @torch.no_grad()
    def _scatter_back(self) -> None:
        dp = self.mesh.dp
        if dp == 1:
            flat = self.master.data
        else:
            mine = self._padded_piece()
            parts = [torch.empty_like(mine) for _ in range(dp)]
            with spans.span("all_gather", track="comm"):
                comms.all_gather(parts, mine, self.groups.dp_group)
            self._sent += mine.nbytes * (dp - 1)
            flat = torch.cat(parts)[:self.n]
        for p, v in zip(self.params, flat.split([q.numel() for q in self.params]), strict=True):
            p.data.copy_(v.view_as(p))

    def _padded_piece(self) -> torch.Tensor:
        mine = self.master.data
        extra = self.per - mine.numel()
        return torch.cat([mine, mine.new_zeros(extra)]) if extra else mine.clone()

    def shard_pieces(self, saving: bool) -> list[sharded.Piece]:
        """The runs of elements this rank's piece owns, stepped as parts of the flat parameter."""
        out = []
        for name, start, p, at, n in self.runs(saving, every_replica=True):
            a = self.base[id(p)] + at
            x, y = max(a, self.lo), min(a + n, self.hi)
            if x < y:
                view = p.data.view(-1).narrow(0, at + x - a, y - x)
                out.append(sharded.Piece(name, start + x - a, view, self.master, at=x - self.lo))
        return out

    def save_shards(self, folder: Path, run: str, common, keep: int) -> None:
        """Write this rank's piece of a checkpoint folder."""
        sharded.save(folder, self.world, run, self.shard_pieces(saving=True), self.optimizer,
                     common, keep, self.name)

    def load_shards(self, folder: Path, manifest: dict) -> None:
        """Every parameter of the stage first, then this rank's piece with its optimizer state."""
        sharded.load(folder, manifest, self.pieces(saving=False), _StateOnly())
        self.master.data.copy_(self._flat_params()[self.lo:self.hi])
        sharded.load(folder, manifest, self.shard_pieces(saving=False), self.optimizer)


def make(cfg: TrainConfig, world: World, module: nn.Module, precision: Precision):
    """This rank's stage of the GPT on the mesh, with ZeRO over the data-parallel groups."""
    return Mesh3DZero(cfg, world, module, precision)
