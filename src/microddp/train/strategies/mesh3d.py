"""`--model gpt --tp T --pp P`: the GPT on a DP x PP x TP mesh, dp = nproc / (T * P).

The mesh is comms/mesh3d.py's (TP innermost, PP outermost: rank = stage * dp * tp + replica * tp
+ tp_rank). Each rank builds the same seeded whole GPT, keeps its stage's tensor-parallel share
(tp/stages.py) and drops nothing else from the loop's view: the whole model object stays for
evaluation and the sample, refilled from the shards when asked. A replica's P * T ranks read the
same slice of each global batch (the first stage its tokens, the last its targets); the slice is
cut into micro-batches that a pipeline schedule (--schedule gpipe | 1f1b, microddp.pipeline's
torch-shaped classes) runs, each micro-batch's loss its sum times the loop's scale, so the
gradients add up to one process's; after the window, every shard's gradient is averaged over
its data-parallel group in one flat all-reduce. The loss is counted by the last stage's tensor
rank 0, once per replica.

Checkpoints are one shard per rank (train/sharded.py): replica 0's ranks write their slices as
runs of the whole parameters' elements (a row-parallel weight's slice is one run per row), with
their optimizer state; any other mesh reads them back, because a piece names the elements it
holds. model.pt is the whole model.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from ... import comms, pipeline, spans
from ...comms.mesh3d import Mesh3D
from ...data import Split, evaluate
from ...errors import MicroDDPError
from ...timing import straggle_after_forward
from ...tp.stages import TensorParallelStage, blocks_per_stage, stage_of
from ...world.world import World
from .. import sharded
from ..build import Precision, build_optimizer
from ..config import TrainConfig, microbatches, stages
from .base import Strategy

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


def mesh_of(cfg: TrainConfig, n: int) -> Mesh3D:
    """The mesh of a run on `n` ranks: --tp, --pp, and dp the rest."""
    p = stages(cfg, n)
    return Mesh3D(dp=n // (cfg.tp * p), pp=p, tp=cfg.tp)


class Mesh3DParallel(Strategy):
    """This rank's stage of the GPT, split over its tensor-parallel group, in a pipeline,
    averaged over its data-parallel group."""
    sharded_checkpoints = True

    def __init__(self, cfg: TrainConfig, world: World, module: nn.Module,
                 precision: Precision) -> None:
        super().__init__(cfg, world, module, precision)
        self.name = cfg.strategy
        self.mesh = mesh_of(cfg, world.world_size)
        g = self.groups = self.mesh.groups(world.rank)
        self.stage = TensorParallelStage(module, g.stage, self.mesh.pp, g.tp_group)
        self.optimizer = build_optimizer(cfg, self.stage.parameters())
        self.data_rank, self.data_size = g.replica, self.mesh.dp
        self.counts_loss = self.stage.is_last and g.tp_rank == 0
        self.m = microbatches(cfg, world.world_size)
        self._schedules: dict[int, object] = {}
        self._scale = 1.0
        self._memory: dict[str, int] = {}
        self._sent = 0

    def describe(self) -> str:
        """How this strategy is set up, for the run's first lines."""
        mesh = self.mesh
        counts = blocks_per_stage(self.cfg.depth, mesh.pp)
        return (f"dp x pp x tp = {mesh.dp} x {mesh.pp} x {mesh.tp} (tp innermost, pp outermost)"
                + (f", blocks per stage {counts}, schedule {self.cfg.schedule}, {self.m} "
                   "micro-batches" if mesh.pp > 1 else ""))

    def _loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # a micro-batch's mean loss times its windows, at the loop's scale: the loss sum
        return self.stage.loss(out, target) * (len(target) * self._scale)

    def _schedule(self, k: int):
        """The pipeline schedule for a slice of k samples (one per size: its shapes are fixed
        by its first step)."""
        if k not in self._schedules:
            g = self.groups
            stage = pipeline.PipelineStage(self.stage, g.stage, self.mesh.pp, self.world.device,
                                           group=g.pp_group)
            cls = getattr(pipeline, SCHEDULES[self.cfg.schedule])
            self._schedules[k] = cls(stage, min(self.m, k), loss_fn=self._loss,
                                     scale_grads=False)
        return self._schedules[k]

    def micro_step(self, x: torch.Tensor, y: torch.Tensor, scale: float,
                   sync: bool) -> torch.Tensor | None:
        """Forward and backward of the replica's slice through this rank's stage; returns the
        slice's summed loss on the rank that counts it."""
        k, total = len(y), 0.0
        if k:  # a replica's ranks share the slice: all skip an empty one together
            self._scale = scale
            t0 = time.perf_counter()
            if self.mesh.pp == 1:
                with spans.span("forward"):
                    loss = self._loss(self.stage(x), y)
                if self.slow > 1:
                    straggle_after_forward(time.perf_counter() - t0, self.slow)
                with spans.span("backward"):
                    loss.backward()
                total = loss.item()
            else:
                losses: list[torch.Tensor] = []
                schedule = self._schedule(k)
                first, last = self.stage.is_first, self.stage.is_last
                args = (x,) if first else ()
                kwargs = {"target": y, "losses": losses} if last else {}
                with spans.span("pipeline"):
                    schedule.step(*args, **kwargs, return_outputs=False)
                total = sum(v.item() for v in losses)
        if sync:
            self._average()
        if not self.counts_loss:
            return None
        return torch.tensor(total / scale, dtype=torch.float64)

    def _average(self) -> None:
        """Average every shard's gradient over the data-parallel group, in one flat message."""
        params = list(self.stage.parameters())
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.mesh.dp == 1:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        self._sent += 2 * flat.nbytes * (self.mesh.dp - 1) // self.mesh.dp
        with spans.span("all_reduce", track="comm"):
            comms.all_reduce(flat, "sum", self.groups.dp_group)
        flat /= self.mesh.dp
        for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p.grad.copy_(g.view_as(p))

    def measured(self) -> nn.Module:
        """This rank's stage shards: what its step measures."""
        return self.stage

    @torch.no_grad()
    def _whole(self) -> dict[str, torch.Tensor]:
        """The whole GPT's state_dict on every rank: each stage's tensor-parallel group gathers
        its stage, replica 0's tensor rank 0 of each stage broadcasts it."""
        mine = self.stage.full_state()
        cfg, mesh, out = self.module.cfg, self.mesh, {}
        for name, like in self.module.state_dict().items():
            owner = mesh.rank(stage_of(name, cfg.n_layer, mesh.pp), 0, 0)
            buf = mine[name] if self.world.rank == owner else torch.empty_like(like)
            if mesh.size > 1:
                comms.broadcast(buf, src=owner)
            out[name] = buf
        return out

    def evaluate(self, split: Split) -> dict:
        """Validation loss and accuracy of the whole model, gathered from the shards."""
        self.module.load_state_dict(self._whole())
        return evaluate(self.module, split, self.world)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole GPT's state_dict on rank 0 (every rank takes part)."""
        whole = self._whole()
        return whole if self.world.rank == 0 else None

    def memory(self) -> dict[str, int]:
        """Bytes of this rank's shards, their gradients and optimizer state, and bytes sent."""
        return dict(self._memory)

    def runs(self, saving: bool, every_replica: bool = False) -> list[tuple]:
        """This rank's parameters as runs of the whole parameters' elements, padding left out:
        (name, first element in the whole parameter, local parameter, first local element,
        length). Saving, only replica 0 writes (unless `every_replica`), and a replicated
        parameter only its tensor rank 0."""
        g, out = self.groups, []
        if saving and g.replica != 0 and not every_replica:
            return out
        seen = set()
        for name, p, dim, whole in self.stage.layout():
            if id(p) in seen:  # a tied head: the embedding's runs already
                continue
            seen.add(id(p))
            if dim is None:
                if not (saving and g.tp_rank != 0):
                    out.append((name, 0, p, 0, p.numel()))
                continue
            per = p.shape[dim]
            lo = g.tp_rank * per
            valid = max(0, min(per, whole - lo))
            if valid == 0:
                continue
            if dim == 0:
                row = p[0].numel() if p.dim() > 1 else 1
                out.append((name, lo * row, p, 0, valid * row))
            else:  # a row-parallel weight (out, in / p): one run per output row
                out += [(name, i * whole + lo, p, i * per, valid) for i in range(p.shape[0])]
        return out

    def pieces(self, saving: bool) -> list[sharded.Piece]:
        """The runs as checkpoint pieces, each stepped by the optimizer as its own parameter."""
        return [sharded.Piece(name, start, p.data.view(-1).narrow(0, at, n), p, at=at)
                for name, start, p, at, n in self.runs(saving)]

    def save_shards(self, folder: Path, run: str, common, keep: int) -> None:
        """Write this rank's shard of a checkpoint folder."""
        sharded.save(folder, self.world, run, self.pieces(saving=True), self.optimizer,
                     common, keep, self.name)

    def load_shards(self, folder: Path, manifest: dict) -> None:
        """Read this rank's part back from a checkpoint folder of any mesh."""
        sharded.load(folder, manifest, self.pieces(saving=False), self.optimizer)


def check(cfg: TrainConfig, n: int) -> None:
    """The mesh's own settings: --tp x --pp ranks per replica dividing --nproc, stages that
    fit the blocks, a schedule this strategy runs, micro-batches that fit a replica's slice."""
    for flag, value in (("--pp", cfg.pp), ("--microbatches", cfg.microbatches)):
        if value is not None and value < 1:
            raise MicroDDPError(f"{flag} must be at least 1, got {value}")
    p = stages(cfg, n)
    if cfg.tp * p > n:
        raise MicroDDPError(f"--tp {cfg.tp} x --pp {p} = {cfg.tp * p} ranks per replica, more "
                            f"than --nproc {n}; use --nproc {cfg.tp * p} or a smaller mesh")
    if n % (cfg.tp * p):
        raise MicroDDPError(f"--tp {cfg.tp} x --pp {p} = {cfg.tp * p} ranks per replica must "
                            f"divide --nproc {n} (dp = nproc / (tp x pp)); use --nproc "
                            f"{cfg.tp * p * max(1, n // (cfg.tp * p))}")
    if cfg.depth < p:
        raise MicroDDPError(f"--pp {p} stages need at least {p} blocks, the GPT has --depth "
                            f"{cfg.depth}; use --depth {p} or more, or fewer stages")
    if p > 1 and cfg.schedule not in SCHEDULES:
        raise MicroDDPError(f"--schedule {cfg.schedule}: the GPT's pipeline runs "
                            f"{' | '.join(SCHEDULES)}; pick one of them")
    if cfg.strategy == "pp" and n != cfg.tp * p:
        raise MicroDDPError(f"--strategy pp is one pipeline (no replicas): --tp {cfg.tp} x --pp "
                            f"{p} must be --nproc {n}; use --strategy dp for replicas")
    if cfg.engine != TrainConfig.engine:
        raise MicroDDPError(f"--tp {cfg.tp} --pp {p} averages gradients over its own "
                            f"data-parallel groups, not through --engine {cfg.engine}; drop "
                            "--engine")
    if cfg.amp:
        raise MicroDDPError(f"--amp with --tp {cfg.tp} --pp {p} is not supported yet; drop --amp")
    per_replica = cfg.batch_size // max(1, n // (cfg.tp * p))
    m = microbatches(cfg, n)
    if p > 1 and per_replica and m > per_replica:
        raise MicroDDPError(f"--microbatches {m} is more than the {per_replica} samples each "
                            f"pipeline gets per step (--batch-size {cfg.batch_size} over "
                            f"{n // (cfg.tp * p)} replicas); use at most {per_replica}")


def make(cfg: TrainConfig, world: World, module: nn.Module, precision: Precision) -> Strategy:
    """This rank's stage of the GPT, split over its tensor-parallel group."""
    return Mesh3DParallel(cfg, world, module, precision)
