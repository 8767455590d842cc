"""`--model gpt --cp C [--tp T]`: the GPT on a DP x CP x TP mesh, dp = nproc / (C * T).

Rank order: TP innermost, then CP, then DP outermost,

    rank = replica * (cp * tp) + cp_rank * tp + tp_rank

so a tensor-parallel group is tp consecutive ranks (it talks in every layer), a ring of context
parallelism is tp apart (one K/V hop per block per ring step), and replicas meet once per step.
Every rank builds the same seeded whole GPT and keeps its ContextTensorParallelGPT share
(cp/tensor_parallel.py): its heads, MLP units and vocabulary rows over the TP group, its two
zigzag chunks of every window over the CP group. A replica's C * T ranks read the same slice of
each global batch. Gradients: finish_grads() sums each shard's over the CP group (its ranks
saw other tokens), then one flat all-reduce averages it over the DP group. The loss is counted
by CP rank 0, TP rank 0 of each replica, after a sum of the CP shares.

Checkpoints are train/sharded.py's, as the dp x pp x tp mesh writes them: replica 0's CP rank 0
writes its TP slices as runs of the whole parameters' elements, so any mesh reads them back.
model.pt is the whole GPT. Pipeline stages (--pp) with --cp are not built: refused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from ... import comms, spans
from ...cp.tensor_parallel import ContextTensorParallelGPT
from ...data import TEXT_BLOCK, Split, evaluate
from ...errors import MicroDDPError
from ...timing import straggle_after_forward
from ...tp.stages import split_dim
from ...world.world import World, distributed, group_size
from ..build import Precision, build_optimizer
from ..config import TrainConfig
from .mesh3d import Mesh3DParallel


@dataclass(frozen=True)
class ContextMesh:
    """`dp` replicas, each a `cp` x `tp` grid: TP innermost, then CP, DP outermost."""

    dp: int
    cp: int
    tp: int

    @property
    def size(self) -> int:
        """Ranks in the mesh."""
        return self.dp * self.cp * self.tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(replica, cp rank, tp rank) of a global rank."""
        if not 0 <= rank < self.size:
            raise MicroDDPError(f"rank {rank} is outside a mesh of {self.size} ranks")
        replica, rest = divmod(rank, self.cp * self.tp)
        return (replica, *divmod(rest, self.tp))

    def rank(self, replica: int, c: int, t: int) -> int:
        """The global rank of (replica, cp rank, tp rank)."""
        return replica * self.cp * self.tp + c * self.tp + t

    def lines(self) -> dict[str, list[list[int]]]:
        """Every group of each axis, in one order (what every rank creates)."""
        d, c, t, r = range(self.dp), range(self.cp), range(self.tp), self.rank
        return {"tp": [[r(a, b, x) for x in t] for a in d for b in c],
                "cp": [[r(a, b, x) for b in c] for a in d for x in t],
                "dp": [[r(a, b, x) for a in d] for b in c for x in t]}

    def groups(self, rank: int) -> dict[str, object]:
        """This rank's tp, cp and dp groups, every group made once by every rank in one order.
        A group that is the whole world is None; a group of one rank is a real group of one
        (None would mean the whole world to the models)."""
        made: dict[str, object] = {"tp": None, "cp": None, "dp": None}
        if not distributed():
            return made
        if group_size() != self.size:
            raise MicroDDPError(f"a mesh of dp {self.dp} x cp {self.cp} x tp {self.tp} needs "
                                f"{self.size} ranks, the world has {group_size()}")
        for axis, lists in self.lines().items():
            for ranks in lists:
                if len(ranks) == self.size:
                    break
                group = comms.new_group(ranks)
                if rank in ranks:
                    made[axis] = group
        return made


def mesh_of(cfg: TrainConfig, n: int) -> ContextMesh:
    """The mesh of a run on `n` ranks: --cp, --tp, and dp the rest."""
    return ContextMesh(dp=n // (cfg.cp * cfg.tp), cp=cfg.cp, tp=cfg.tp)


@dataclass(frozen=True)
class _Coords:
    replica: int  # which checkpoint writer: 0 only for replica 0's CP rank 0
    tp_rank: int


class _Layout:
    """The tensor-parallel GPT's parameters by the whole GPT's names, with the dimension each is
    split along (tp/stages.py's layout, for one stage): what checkpoints are cut from."""

    def __init__(self, tp) -> None:
        self.tp = tp

    def layout(self) -> list[tuple[str, nn.Parameter, int | None, int]]:
        """(whole GPT's name, local parameter, split dimension or None, whole length)."""
        cfg, out = self.tp.cfg, []
        for local, p in self.tp.named_parameters(remove_duplicate=False):
            name = "head.weight" if local == "head_weight" else local
            dim = split_dim(name)
            whole = (0 if dim is None else cfg.vocab_size if name in ("wte.weight", "head.weight")
                     else cfg.hidden if ".mlp." in name else cfg.d_model)
            out.append((name, p, dim, whole))
        return out


class ContextParallel(Mesh3DParallel):
    """This rank's chunks of every window and share of the GPT's heads, averaged over DP.
    Checkpoints, runs and the learning rate are the 3-D mesh's (Mesh3DParallel)."""
    sharded_checkpoints = True

    def __init__(self, cfg: TrainConfig, world: World, module: nn.Module,
                 precision: Precision) -> None:
        super(Mesh3DParallel, self).__init__(cfg, world, module, precision)
        self.name = cfg.strategy
        self.mesh = mesh_of(cfg, world.world_size)
        replica, c, t = self.mesh.coords(world.rank)
        g = self.mesh.groups(world.rank)
        self.tp_group, self.cp_group, self.dp_group = g["tp"], g["cp"], g["dp"]
        self.model = ContextTensorParallelGPT(module, self.tp_group, self.cp_group)
        self.stage = _Layout(self.model.tp)  # what Mesh3DParallel.runs cuts checkpoints from
        self.groups = _Coords(replica if c == 0 else -1, t)
        self.optimizer = build_optimizer(cfg, self.model.tp.parameters())
        self.data_rank, self.data_size = replica, self.mesh.dp
        self.counts_loss = c == 0 and t == 0
        self._memory: dict[str, int] = {}
        self._sent = 0

    def describe(self) -> str:
        """How this strategy is set up, for the run's first lines."""
        m = self.mesh
        return (f"dp x cp x tp = {m.dp} x {m.cp} x {m.tp} (tp innermost, dp outermost), "
                f"{TEXT_BLOCK // (2 * m.cp)}-token chunks, 2 per rank")

    def micro_step(self, x: torch.Tensor, y: torch.Tensor, scale: float,
                   sync: bool) -> torch.Tensor | None:
        """Forward and backward of the replica's slice on this rank's chunks; the slice's
        summed loss on the rank that counts it (every CP rank takes part in the sum)."""
        total = 0.0
        if len(y):  # a replica's ranks share the slice: all skip an empty one together
            t0 = time.perf_counter()
            with spans.span("forward"):
                # the share of the slice's mean loss, times its windows: the loss sum's share
                share = self.model.loss(x, y) * len(y)
            if self.slow > 1:
                straggle_after_forward(time.perf_counter() - t0, self.slow)
            with spans.span("backward"):
                (share * scale).backward()
            total = self.model.global_loss(share)
        if sync:
            self._average()
        if not self.counts_loss:
            return None
        return torch.tensor(total, dtype=torch.float64)

    def _average(self) -> None:
        """Sum each shard's gradient over CP, then average it over DP in one flat message."""
        params = list(self.model.tp.parameters())
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        with spans.span("cp_grads", track="comm"):
            self.model.finish_grads()
        if self.mesh.dp == 1:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        self._sent += 2 * flat.nbytes * (self.mesh.dp - 1) // self.mesh.dp
        with spans.span("all_reduce", track="comm"):
            comms.all_reduce(flat, "sum", self.dp_group)
        flat /= self.mesh.dp
        for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p.grad.copy_(g.view_as(p))

    def measured(self) -> nn.Module:
        """This rank's TP shards (every CP rank of a replica holds the same)."""
        return self.model.tp

    @torch.no_grad()
    def _whole(self) -> dict[str, torch.Tensor]:
        """The whole GPT on every rank: each TP group gathers its shards (every replica and
        CP rank holds the same ones, so no further message)."""
        return self.model.tp.full_state_dict()

    def evaluate(self, split: Split) -> dict:
        """Validation loss and accuracy of the whole model, gathered from the TP shards."""
        self.module.load_state_dict(self._whole())
        return evaluate(self.module, split, self.world)


def check(cfg: TrainConfig, n: int) -> None:
    """--cp's own settings: a dp x cp x tp mesh dividing --nproc, no pipeline, windows that
    split into 2 * cp chunks, and only what this strategy runs."""
    c, t = cfg.cp, cfg.tp
    if (cfg.pp or 1) > 1:
        raise MicroDDPError(f"--cp {c} with --pp {cfg.pp}: pipeline stages with context "
                            "parallelism are not built; drop --pp (dp x cp x tp)")
    if n % (c * t):
        raise MicroDDPError(f"--cp {c} x --tp {t} = {c * t} ranks per replica must divide "
                            f"--nproc {n} (dp = nproc / (cp x tp)); use --nproc "
                            f"{c * t * max(1, n // (c * t))}")
    if TEXT_BLOCK % (2 * c):
        raise MicroDDPError(f"--cp {c}: the {TEXT_BLOCK}-byte windows must split into 2 x cp "
                            f"= {2 * c} equal chunks; use --cp 1, 2, 4, 8 or 16")
    for flag, bad in (("--engine", cfg.engine != TrainConfig.engine), ("--amp", cfg.amp),
                      ("--drift-every", cfg.drift_every)):
        if bad:
            raise MicroDDPError(f"--cp {c} does not take {flag} (it averages gradients over "
                                f"its own data-parallel groups, in float32); drop {flag}")


def make(cfg: TrainConfig, world: World, module: nn.Module, precision: Precision):
    """This rank's share of the GPT on the dp x cp x tp mesh."""
    return ContextParallel(cfg, world, module, precision)
