"""`--strategy pp` and `--strategy dp-pp`: the model cut into --pp stages run by a pipeline
schedule, each stage replicated over its data-parallel group with microddp's DDP (dp-pp).

The ranks form a mesh (comms/mesh.py): replica d's pipeline is ranks d*pp .. d*pp+pp-1, and
stage s's replicas are every pp-th rank. Every rank of a pipeline reads its replica's slice of
the global batch (the first stage its inputs, the last its labels). Each micro-step runs the
whole schedule with DDP's synchronisation off, so the micro-batches' gradients only add up;
the window's last micro-step then averages them over the replicas, once per optimizer step.

A rank keeps only its stages' parameters: the other layers are emptied after the model is
built (every rank builds the same initial model from the seed, as with dp) and refilled only
for evaluation and for model.pt.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ... import comms, pipeline, spans
from ...comms.mesh import Mesh
from ...data import Split, evaluate
from ...errors import MicroDDPError
from ...monitor.memory import measure
from ...timing import straggle_after_forward
from ...world.world import World
from .. import sharded
from ..build import Precision, build_optimizer
from ..config import TrainConfig, microbatches, stages
from .base import Strategy
from .traffic import ring_all_reduce_bytes

VIRTUAL = {"interleaved": 2}  # stages per rank; 1 for the other schedules


class Pipeline(Strategy):
    """Pipeline (and DP x PP) parallelism: this rank's stages run a schedule; gradients averaged once per step over the DP group."""
    sharded_checkpoints = True

    def __init__(self, cfg: TrainConfig, world: World, module: nn.Module,
                 precision: Precision) -> None:
        super().__init__(cfg, world, module, precision)
        self.name = cfg.strategy
        p = stages(cfg, world.world_size)
        self.mesh = Mesh(dp=world.world_size // p, pp=p)
        self.groups = self.mesh.groups(world.rank)
        self.data_rank, self.data_size = self.groups.replica, self.mesh.dp
        self.virtual = VIRTUAL.get(cfg.schedule, 1)
        self.m = microbatches(cfg, world.world_size)
        self.schedule = self._build(self.m)
        cut = pipeline.split_model(module, p * self.virtual)
        self.mine = {s: cut[s] for s in self.schedule.stages_of(self.groups.stage)}
        # Each stage's replicas average its gradients with microddp's DDP over their group.
        self.replicated = pipeline.Replicated(self.mine, self.groups.dp_group, self.mesh.dp)
        self.params = [q for m in self.mine.values() for q in m.parameters()]
        owned = {id(q) for q in self.params}
        self.names = {id(q): n for n, q in module.named_parameters()}
        self.shapes = {n: q.shape for n, q in module.named_parameters()}
        self.foreign = [q for q in module.parameters() if id(q) not in owned]
        self._release()
        self.optimizer = build_optimizer(cfg, self.params)
        self.last_stage = self.schedule.stages - 1 in self.mine
        self._memory: dict[str, int] = {}
        self._sent: list[int] = []
        self._straggling = False  # True inside micro_step: evaluation is never slowed
        if self.slow > 1:
            for stage in self.mine.values():
                self._slow_down(stage)

    def _slow_down(self, stage: nn.Module) -> None:
        """--straggler for a pipeline rank: after each forward of its stage in a training step,
        sleep so that the stage's forward and backward (counted as two forwards, as for data
        parallelism: the schedule's waits for other stages are no computing of its own) take
        `slow` times as long."""
        started: list[float] = []

        def before(module, args) -> None:
            started.append(time.perf_counter())

        def after(module, args, output) -> None:
            t0 = started.pop()
            if self._straggling:
                with spans.span("straggle"):
                    straggle_after_forward(time.perf_counter() - t0, self.slow)

        stage.register_forward_pre_hook(before)
        stage.register_forward_hook(after)

    def _build(self, m: int) -> pipeline.Schedule:
        schedule = pipeline.build(self.cfg.schedule, self.mesh.pp, m, self.virtual)
        pipeline.validate(schedule)
        return schedule

    def describe(self) -> str:
        """How this strategy is set up, for the run's first lines."""
        return (f"{self.name}: {self.mesh.pp} stage(s) x {self.mesh.dp} replica(s), schedule "
                f"{self.cfg.schedule}, {self.m} micro-batches; this rank: replica "
                f"{self.groups.replica}, stage(s) {sorted(self.mine)}")

    def _release(self) -> None:
        """Let go of the layers this rank does not run (their storage, not their objects)."""
        for q in self.foreign:
            q.data = torch.empty(0, dtype=q.dtype, device=q.device)

    def micro_step(self, x: torch.Tensor, y: torch.Tensor, scale: float,
                   sync: bool) -> torch.Tensor | None:
        """Forward and backward of one slice at the loop's scale; returns the summed loss."""
        k = len(x)
        loss = None
        if k:  # a replica with no sample in this step runs no schedule, but still syncs
            schedule = self.schedule if k >= self.m else self._build(k)

            # run_schedule weighs micro-batch i's mean loss by n_i / k: times k * scale, it
            # contributes its loss sum times scale, as in every other strategy.
            def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
                return F.cross_entropy(out.float(), target) * (k * scale)

            record = [] if spans.enabled() else None
            messages = [] if spans.enabled() else None
            self._straggling = True
            try:
                with self.replicated.no_sync():
                    loss = pipeline.run_schedule(schedule, self.replicated.modules, x, y,
                                                 loss_fn, group=self.groups.pp_group,
                                                 record=record, sent=self._sent,
                                                 messages=messages)
            finally:
                self._straggling = False
            for a, start, end in record or ():  # the schedule's compute, on the timeline
                spans.add_span("forward" if a.kind == "F" else "backward", start, end,
                               action=str(a))
            for a, start, end, wait_start, wait_end in messages or ():
                # a send is posted (comm); a receive is the time this rank waited for the data
                if a.kind.startswith("SEND"):
                    spans.add_span(f"send {a}", start, end, track="comm", action=str(a))
                else:
                    spans.add_span(f"recv {a}", wait_start, wait_end, track="comm_wait",
                                   action=str(a))
        if sync and self.mesh.dp > 1:  # once per optimizer step, not per micro-batch
            with spans.span("backward"):
                self.replicated.average()
            self._sent += [ring_all_reduce_bytes(m, self.mesh.dp) for m in self.mine.values()]
        if not self.last_stage:
            return None
        return torch.tensor(0.0 if loss is None else loss / scale, dtype=torch.float64)

    def step(self) -> None:
        """The optimizer step of this strategy, then gradients cleared."""
        self._memory = {**measure(self.params, self.optimizer), "sent_per_step": sum(self._sent)}
        self._sent = []
        with spans.span("optimizer", track="optim"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    @contextlib.contextmanager
    def _whole(self, to: int | None) -> Iterator[nn.Module]:
        """The whole model on rank `to` (every rank if None), each layer from replica 0's rank
        that holds it; afterwards the borrowed layers are let go again."""
        owners = {}
        for s in range(self.schedule.stages):
            owner = self.mesh.rank(0, self.schedule.rank_of(s))
            for q in pipeline.split_model(self.module, self.schedule.stages)[s].parameters():
                owners[id(q)] = owner
        rank = self.world.rank
        try:
            for q in self.module.parameters():
                owner, name = owners[id(q)], self.names[id(q)]
                holds = q.numel() > 0 or self.shapes[name].numel() == 0
                if to is None:
                    buf = q.data if rank == owner else torch.empty(self.shapes[name],
                                                                   dtype=q.dtype)
                    comms.broadcast(buf, src=owner)
                elif owner != to:
                    if rank == owner:
                        comms.send(q.data.contiguous(), dst=to)
                        continue
                    if rank != to:
                        continue
                    buf = torch.empty(self.shapes[name], dtype=q.dtype)
                    comms.recv(buf, src=owner)
                else:
                    continue
                if not holds:
                    q.data = buf
            yield self.module
        finally:
            self._release()

    def evaluate(self, split: Split) -> dict:
        """Test loss and accuracy of the whole model, equal on every rank."""
        with self._whole(None) as full:
            return evaluate(full, split, self.world)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state_dict, for model.pt."""
        with self._whole(0) as full:
            if self.world.rank == 0:
                return {k: v.detach().clone() for k, v in full.state_dict().items()}
        return None

    def memory(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state on this rank, from the live tensors."""
        return dict(self._memory)

    def pieces(self) -> list[sharded.Piece]:
        """Replica 0 saves its stages' parameters whole; the other replicas hold copies."""
        if self.groups.replica != 0:
            return []
        return [sharded.Piece(self.names[id(q)], 0, q.data.view(-1), q) for q in self.params]

    def save_shards(self, folder: Path, run: str, common, keep: int) -> None:
        """Write this rank's shard of a checkpoint folder."""
        sharded.save(folder, self.world, run, self.pieces(), self.optimizer, common, keep,
                     self.name)

    def load_shards(self, folder: Path, manifest: dict) -> None:
        """Read this rank's part back from a checkpoint folder of any layout."""
        pieces = [sharded.Piece(self.names[id(q)], 0, q.data.view(-1), q) for q in self.params]
        sharded.load(folder, manifest, pieces, self.optimizer)


def check(cfg: TrainConfig, n: int) -> None:
    """The settings a pipeline needs: stages that divide the ranks and fit the model, and
    micro-batches that fit a replica's share of the batch (the GPT: its mesh's checks)."""
    if cfg.model == "gpt":
        from .mesh3d import check as mesh_check

        return mesh_check(cfg, n)
    for flag, value in (("--pp", cfg.pp), ("--microbatches", cfg.microbatches)):
        if value is not None and value < 1:
            raise MicroDDPError(f"{flag} must be at least 1, got {value}")
    p = stages(cfg, n)
    if n % p:
        raise MicroDDPError(f"--pp {p} stages do not divide --nproc {n} ranks into whole "
                            f"replicas; use a --pp that divides {n}")
    if cfg.strategy == "pp" and p != n:
        raise MicroDDPError(f"--strategy pp puts one stage on every rank, so --pp is {n} "
                            f"(--nproc), not {p}; use --strategy dp-pp for replicated stages")
    virtual = 2 if cfg.schedule == "interleaved" else 1
    if p * virtual > cfg.depth:
        raise MicroDDPError(f"--pp {p}" + (" with the interleaved schedule (2 stages per "
                            "rank)" if virtual > 1 else "") + f" needs {p * virtual} stages, "
                            f"more than the model's {cfg.depth} layers (--depth); use "
                            f"--depth {p * virtual} or more, or fewer stages")
    if cfg.engine != TrainConfig.engine:
        raise MicroDDPError(f"--engine {cfg.engine}: the pipeline strategies replicate each "
                            "stage with microddp's DDP; drop --engine")
    if cfg.amp is not None:
        raise MicroDDPError(f"--amp {cfg.amp} is not supported with --strategy {cfg.strategy} "
                            "(stages exchange float32 activations); drop --amp")
    per_replica = cfg.batch_size // max(1, n // p)
    m = microbatches(cfg, n)
    if per_replica and m > per_replica:
        raise MicroDDPError(f"--microbatches {m} is more than the {per_replica} samples each "
                            f"pipeline gets per step (--batch-size {cfg.batch_size} over "
                            f"{n // p} replicas); use at most {per_replica}")


def make(cfg: TrainConfig, world: World, module: nn.Module, precision: Precision) -> Strategy:
    """This rank's stages of the pipeline, replicated over its data-parallel group (the GPT:
    its stage on a dp x pp x tp mesh, mesh3d.py)."""
    if cfg.model == "gpt":
        from .mesh3d import make as on_mesh

        return on_mesh(cfg, world, module, precision)
    return Pipeline(cfg, world, module, precision)
