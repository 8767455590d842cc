"""The parameter server (rank 0; with --servers S, ranks 0..S-1, one shard of the parameters
each): owns its parameters and their optimizer, applies the workers' gradients under the
staleness rule (policy.py), and keeps going when a worker is lost. Shards are independent: each
server keeps its own version and staleness, as a worker's gradient for a shard carries the
version of that shard it was computed from; at the end server 0 gathers the whole model.

An `Observer` sees every update and every lost worker (the training job prints progress,
evaluates and checkpoints from there); `state_dict()` is everything a restarted server needs
to go on where it was: parameters, optimizer, version, gradients applied, and each worker's
place in the data."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from .. import spans
from ..errors import MicroDDPError
from .config import SERVER, PSConfig
from .flat import FlatModel
from .policy import Held, Staleness
from .protocol import BYE, GRAD, LOST, PARAMS, STOP, Inbox, recv, send
from .task import Task, accuracy

# A receive that outlives this is abandoned by its thread; the server's own worker_timeout,
# applied only to workers that owe it a gradient, decides much earlier who is lost.
_BACKSTOP_S = 3600.0


@dataclass
class ServerReport:
    """What the server saw: every applied gradient's staleness, how many gradients each update
    averaged, which worker was lost at which version and why, throughput and accuracy.

    After a resume the counts run on from the checkpoint; `samples` and `seconds` cover only
    this run, so `samples_per_s` is this run's own speed."""

    workers: int
    updates: int = 0
    applied: int = 0
    discarded: int = 0  # too stale to apply (late backup gradients)
    staleness: list[int] = field(default_factory=list)
    per_update: list[int] = field(default_factory=list)
    lost: list[tuple[int, int]] = field(default_factory=list)  # (worker rank, version)
    lost_reasons: dict[int, str] = field(default_factory=dict)
    samples: int = 0
    seconds: float = 0.0
    test_accuracy: float | None = None
    state: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def histogram(self) -> dict[int, int]:
        """Staleness -> number of applied gradients."""
        return dict(sorted(Counter(self.staleness).items()))

    @property
    def samples_per_s(self) -> float:
        """Samples applied per second of the run (0 for an empty run)."""
        return self.samples / self.seconds if self.seconds > 0 else 0.0


class Observer:
    """What the server tells its owner; the default hears nothing."""

    def updated(self, server: Server, used: list[Held]) -> None:
        """An update was applied with the gradients `used` (server.report is up to date)."""

    def lost(self, server: Server, worker: int, reason: str) -> None:
        """`worker` was dropped; the run goes on with the others."""


class Server:
    """A parameter server (rank `rank` < config.servers): holds its shard of the model and its
    optimizer, applies gradients under the staleness bound, hands parameters back."""
    def __init__(self, world_size: int, task: Task, config: PSConfig,
                 observer: Observer | None = None, state: dict | None = None,
                 rank: int = SERVER) -> None:
        self.task, self.config, self.rank = task, config, rank
        self.observer = observer or Observer()
        self.model = task.make_model()
        # the parameters the workers are sent: the optimizer steps this shard's frame in place
        # (with one server, the whole model)
        self.flat = FlatModel(self.model, shards=config.servers)
        self.frame = self.flat.param_frames[rank]
        self.params = self.frame.body
        self.grads = self.flat.grad_frames[rank].body
        mine = self.flat.shard_params[rank]
        self.opt = (task.make_optimizer(mine) if task.make_optimizer else
                    torch.optim.SGD(mine, lr=config.lr, momentum=config.momentum))
        workers = config.workers(world_size)
        self.live = set(workers)  # neither lost nor gone after its goodbye
        self.ssp = Staleness(config.staleness, config.backup_workers, shards=len(workers))
        self.clock = dict.fromkeys(workers, 0)  # the global batch each worker computes next
        self.sent_at: dict[int, float] = {}
        self.stopping = False
        self.report = ServerReport(workers=len(workers))
        if state is not None:
            self.load_state_dict(state)
        # Gradients: `steps` global batches' worth. The run stops at the update that reaches it;
        # an update applies all it holds, so the last may go up to len(workers) - 1 past it.
        self.budget = config.steps * len(workers)
        self.inbox = Inbox(workers, self.params.numel(), _BACKSTOP_S)

    def state_dict(self) -> dict:
        """Everything a restarted server needs (taken between updates: nothing is held)."""
        r = self.report
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                "version": self.ssp.version, "clock": dict(self.clock),
                "updates": r.updates, "applied": r.applied, "discarded": r.discarded,
                "staleness": list(r.staleness), "per_update": list(r.per_update),
                "lost": [list(x) for x in r.lost]}

    def load_state_dict(self, state: dict) -> None:
        """Restore a state_dict taken by a server of the same workers."""
        if sorted(state["clock"]) != sorted(self.clock):
            raise MicroDDPError(f"the server's checkpoint is for workers "
                                f"{sorted(state['clock'])}, this run has {sorted(self.clock)}; "
                                "resume with the same --nproc")
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.ssp.version = int(state["version"])
        self.clock = {int(w): int(c) for w, c in state["clock"].items()}
        r = self.report
        r.updates, r.applied, r.discarded = state["updates"], state["applied"], state["discarded"]
        r.staleness, r.per_update = list(state["staleness"]), list(state["per_update"])
        r.lost = [tuple(x) for x in state["lost"]]

    def give(self, worker: int, kind: int = PARAMS) -> None:
        """Send the current parameters (or STOP); a worker we cannot reach is lost."""
        try:
            with spans.span("send parameters", track="comm"):
                # within the worker timeout: a worker frozen before it posted its receive
                # would otherwise hold the server in this send, and every worker with it
                send(self.frame, worker, kind, self.rank, self.ssp.version, self.clock[worker],
                     timeout=self.config.worker_timeout)
        except (RuntimeError, MicroDDPError) as e:
            self.drop(worker, f"could not send to it: {str(e).splitlines()[0][:160]}")
            return
        if kind == PARAMS:
            self.ssp.sent(worker)
            self.sent_at[worker] = time.perf_counter()

    def drop(self, worker: int, reason: str) -> None:
        """Stop waiting for `worker` (dead or silent): the run goes on with the others."""
        if worker not in self.live:
            return
        self.live.discard(worker)
        self.ssp.lost(worker)
        self.report.lost.append((worker, self.ssp.version))
        self.report.lost_reasons[worker] = reason
        self.observer.lost(self, worker, reason)

    def on_gradient(self, worker: int, version: int, clock: int, grad: torch.Tensor,
                    samples: int, loss: float) -> None:
        """A gradient arrived: hold it for the next update, or discard it (too stale) and send fresh parameters."""
        self.clock[worker] = clock + 1
        if self.stopping:  # the budget is spent: this one is not needed
            self.ssp.lost(worker)
            self.give(worker, STOP)
        elif not self.ssp.arrived(Held(worker, version, grad, samples, loss)):
            self.report.discarded += 1
            self.give(worker)

    def update(self) -> None:
        """Apply the held gradients in one optimizer step and send the new parameters to their workers."""
        with spans.span("optimizer", track="optim"):
            _, used, stale = self.ssp.take(self.config.staleness_lr, out=self.grads)
            self.opt.step()
        r = self.report
        r.updates += 1
        r.applied += len(used)
        r.staleness += stale
        r.per_update.append(len(used))
        r.samples += sum(g.samples for g in used)
        if r.applied >= self.budget:
            self.stopping = True
            r.seconds = time.perf_counter() - self.start
        for g in used:
            self.give(g.worker, STOP if self.stopping else PARAMS)
        spans.next_step()
        self.observer.updated(self, used)

    def check_silence(self) -> None:
        """Drop a worker that has sent nothing for longer than the worker timeout."""
        now = time.perf_counter()
        for worker in list(self.ssp.computing):
            if now - self.sent_at[worker] > self.config.worker_timeout:
                self.drop(worker, f"sent no gradient for {self.config.worker_timeout:g} s")

    def run(self) -> ServerReport:
        """Serve until every worker has said goodbye or been lost; the run's report."""
        self.start = time.perf_counter()
        if self.report.applied >= self.budget:  # resumed from the run's last checkpoint
            self.stopping = True
        for worker in sorted(self.live):
            self.give(worker, STOP if self.stopping else PARAMS)
        while self.live:
            with spans.span("wait for gradients", track="comm_wait"):
                msg = self.inbox.get(timeout=0.05)
            if msg is None:
                self.check_silence()
            elif msg.worker not in self.live:
                pass  # a worker already dropped for silence spoke late: ignore it
            elif msg.kind == LOST:
                self.drop(msg.worker, msg.error)
            elif msg.kind == BYE:
                self.live.discard(msg.worker)
                # before its STOP: another server's budget ran out first (their gradients
                # arrive in different orders), and this worker stopped on its word
                self.stopping = True
            elif msg.kind == GRAD:
                self.on_gradient(msg.worker, msg.version, msg.clock, msg.payload, msg.samples,
                                 msg.loss)
            while not self.stopping and self.ssp.may_update(len(self.live)):
                self.update()
            if not self.stopping and not self.live:
                raise MicroDDPError(
                    f"parameter server (rank {self.rank}): every worker was lost after {self.report.updates} "
                    f"updates ({self.report.lost_reasons}); see the workers' output above, "
                    "fix what killed them and rerun")
        r = self.report
        if not r.seconds:
            r.seconds = time.perf_counter() - self.start
        if self.config.servers > 1:
            self.gather()
        if self.task.test is not None and self.rank == SERVER:
            r.test_accuracy = accuracy(self.model, self.task.test)
        r.state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return r


    def gather(self) -> None:
        """The other servers' final shards into this one's model (on server 0): its report's
        state and accuracy are the whole model's."""
        if self.rank != SERVER:
            send(self.frame, SERVER, PARAMS, self.rank, self.ssp.version)
            return
        for s in range(1, self.config.servers):
            recv(self.flat.param_frames[s], s, self.config.server_timeout)


def run_server(world_size: int, task: Task, config: PSConfig, observer: Observer | None = None,
               state: dict | None = None, rank: int = SERVER) -> ServerReport:
    """Serve `world_size - 1` workers until `config.steps` global batches' worth of gradients
    have been applied; return what happened. `state`: a `Server.state_dict()` to go on from."""
    return Server(world_size, task, config, observer, state, rank).run()
