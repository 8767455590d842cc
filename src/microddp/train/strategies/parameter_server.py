"""`microddp train --strategy async`: the training job on a parameter server (microddp.ps).

Rank 0 serves: it owns the model and the optimizer, applies the workers' gradients under the
staleness bound, prints progress, evaluates after every epoch, checkpoints its own state and
writes the run's files. Ranks 1..N-1 are workers: they pull parameters, compute a gradient on
their shard of a global batch, push it. A worker that dies is dropped and the run goes on (the
launcher starts this job with the workers expendable); a server that dies ends the workers.

A step here is a global batch's worth of applied gradients (one per worker), so --epochs,
--max-steps and --checkpoint-every count the same samples as in a data-parallel run, and with
--staleness 0 a step is exactly one data-parallel step: the same parameters as --nproc 1.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch

from ... import checkpoint, monitor, outputs, ps, spans
from ...data import ShardedBatchSampler, load_dataset
from ...errors import MicroDDPError
from ...launch.run import PEER_GONE
from ...ps.protocol import pull_shard, push_shard
from ...trace import report as trace_report
from ...world.world import World
from ..build import build_model, build_optimizer
from ..config import TrainConfig
from ..report import Reporter, bar, plot_curves

CPU = torch.device("cpu")  # the server and workers exchange flat CPU tensors over gloo
TRACE_WAIT_S = 10.0  # how long the server waits for a finished worker's spans file


def ps_config(cfg: TrainConfig, steps: int) -> ps.PSConfig:
    """The parameter-server settings of an async run of `steps` global batches.

    --monitor-timeout T is how long the server waits for a computing worker before dropping
    it; a worker waits 2T + 5 s for parameters before it concludes its server is gone, since a
    live server may itself be waiting up to T for a frozen worker before it can answer."""
    silent = cfg.monitor_timeout or 60.0
    return ps.PSConfig(steps=steps, lr=cfg.learning_rate,
                       staleness=ps.parse_staleness(cfg.staleness),
                       backup_workers=cfg.backup_workers, staleness_lr=cfg.staleness_lr,
                       stragglers=ps.parse_straggler(cfg.straggler),
                       worker_timeout=silent, server_timeout=2 * silent + 5,
                       servers=cfg.servers)


def check(cfg: TrainConfig, n: int) -> None:
    """A server and at least one worker, sharing the global batch; the server's settings."""
    if n < 2:
        raise MicroDDPError(f"--strategy async needs --nproc of at least 2: a parameter server "
                            f"(rank 0) and at least one worker, got {n}")
    if cfg.servers != 1:
        if not 1 <= cfg.servers < n:
            raise MicroDDPError(f"--servers {cfg.servers}: between 1 and {n - 1} with --nproc "
                                f"{n} (at least one rank must be a worker)")
        for flag, used in (("--resume", cfg.resume), ("--max-restarts", cfg.max_restarts),
                           ("--checkpoint-every", cfg.checkpoint_every),
                           ("--trace", cfg.trace)):
            if used:
                raise MicroDDPError(f"{flag} is not supported with --servers {cfg.servers} "
                                    "yet (a sharded server's checkpoint holds one shard's "
                                    f"optimizer state): drop {flag} or use one server")
    for flag, used in (("--accumulate", cfg.accumulate != 1), ("--amp", cfg.amp is not None),
                       ("--drift-every", cfg.drift_every != 0)):
        if used:
            raise MicroDDPError(f"{flag} is for the data-parallel strategies; --strategy async "
                                f"does not support it: drop {flag}")
    workers = n - cfg.servers
    if cfg.batch_size < workers:
        raise MicroDDPError(f"--batch-size {cfg.batch_size} is the global batch, shared by "
                            f"{workers} workers; use at least {workers}")
    ps_config(cfg, steps=1).check(n)  # staleness, backup workers, straggler ranks


class _Batches:
    """Global batch number `clock` -> its sample indices, as the data-parallel job's sampler
    draws them (epoch after epoch, a short last batch included)."""

    def __init__(self, sampler: ShardedBatchSampler) -> None:
        self.sampler, self.epoch, self.batches = sampler, -1, []

    def __call__(self, clock: int) -> torch.Tensor:
        epoch, k = divmod(clock, len(self.sampler))
        if epoch != self.epoch:
            self.epoch, self.batches = epoch, self.sampler.global_batches(epoch)
        return self.batches[k]


def train(world: World, cfg: TrainConfig, on_step=None) -> dict | None:
    """Run this rank's part of an async job: on the server the fields of the run's
    loop.Result, on a worker None (it never holds the final parameters). `cfg` is
    validated (train/validate.py)."""
    monitor.disable()  # here a lost worker is part of the plan, not a hang to report
    data = load_dataset(cfg.dataset)
    sampler = ShardedBatchSampler(len(data.train), cfg.batch_size, seed=cfg.seed,
                                  allow_empty=True)
    per_epoch = len(sampler)
    steps = min(cfg.max_steps, cfg.epochs * per_epoch) if cfg.max_steps else \
        cfg.epochs * per_epoch
    task = ps.Task(lambda: build_model(cfg, data.in_features, data.n_classes, CPU), data.train,
                   cfg.batch_size, data.test, seed=cfg.seed, batches=_Batches(sampler),
                   make_optimizer=lambda params: build_optimizer(cfg, params))
    config = ps_config(cfg, steps)
    if cfg.trace:
        spans.start()
    state, error = _find(cfg, world) if world.rank == ps.SERVER else (None, None)
    if checkpoint.broadcast_choice(error, world):  # every rank stops on rank 0's error
        raise MicroDDPError(error)
    if world.rank >= config.servers:
        _work(world, cfg, task, config)
        return None
    if world.rank != ps.SERVER:  # another shard's server: its shard to server 0 per epoch
        ps.run_server(world.world_size, task, config,
                      _ShardSender(per_epoch, steps, world.world_size - config.servers),
                      rank=world.rank)
        return None
    job = _Job(cfg, world, per_epoch, steps, task, state, on_step)
    job.server = ps.Server(world.world_size, task, config, job, state and state["ps"])
    report = job.server.run()
    job.finish(report)
    return {"step": job.step, "test_accuracy": job.evaluated[1], "test_loss": job.evaluated[0],
            "out": Path(cfg.out), "params": report.state,
            "resumed_from": state["path"] if state else None, "trace": job.trace_stats}


def _find(cfg: TrainConfig, world: World) -> tuple[dict | None, str | None]:
    """(the server checkpoint to go on from, or None; an error, or None), as the dp job
    decides: --resume, or a restart by the launcher."""
    from ..resume import decide, restart_count

    path, error = decide(cfg, restart_count() > 0,
                         lambda m: print(f"warning: {m}", file=sys.stderr, flush=True))
    if error or path is None:
        return None, error
    state = checkpoint.load(path)
    if "ps" not in state:
        return None, (f"checkpoint {Path(path).name} was not written by a parameter server; "
                      "resume it without --strategy async, or start a new run elsewhere")
    if state["world_size"] != world.world_size:
        return None, (f"checkpoint {Path(path).name} was made with --nproc "
                      f"{state['world_size']} (now {world.world_size}); an async run resumes "
                      "with the same workers: pass the same --nproc")
    state["path"] = path
    return state, None


def _work(world: World, cfg: TrainConfig, task: ps.Task, config: ps.PSConfig) -> None:
    try:
        ps.run_worker(world.rank, world.world_size, task, config)
    except MicroDDPError as e:
        # The server is gone. One line, and PEER_GONE rather than 2: this is no usage error,
        # the launcher stops the whole job (a frozen server never exits by itself), and with
        # --max-restarts it restarts everyone from the server's checkpoint.
        print(f"microddp train: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(PEER_GONE) from None
    if cfg.trace:  # a file the server waits for, not a gather: a lost worker would hang that
        rec = spans.stop()
        walled = [dataclasses.asdict(s) for s in trace_report.to_wall(rec)]
        outputs.write_text(_spans_file(cfg, world.rank), json.dumps(walled))


class _ShardSender(ps.Observer):
    """On a server other than 0: its shard to server 0 at every epoch's end but the last
    (then server 0 gathers the final shards), so server 0 evaluates the whole model. An epoch
    ends on every server at the same count of applied gradients."""

    def __init__(self, per_epoch: int, steps: int, workers: int) -> None:
        self.per_epoch, self.steps, self.workers, self.step = per_epoch, steps, workers, 0
        self.pending = None

    def updated(self, server: ps.Server, used: list[ps.Held]) -> None:
        new = min(self.steps, server.report.applied // self.workers)
        if any(s % self.per_epoch == 0 and s < self.steps for s in range(self.step + 1, new + 1)):
            if self.pending is not None:
                self.pending.wait()
            self.pending = push_shard(server.frame, ps.SERVER)
        self.step = new


def _receive_shards(server: ps.Server, servers: int) -> None:
    """Every other server's shard at this epoch's end into server 0's model."""
    for s in range(1, servers):
        try:
            pull_shard(server.flat.param_frames[s], s, server.config.server_timeout)
        except RuntimeError as e:
            raise MicroDDPError(f"parameter server rank {s} sent no shard at the end of an "
                                f"epoch ({str(e).splitlines()[0][:160]}); see its output "
                                "above") from None


def _spans_file(cfg: TrainConfig, rank: int) -> Path:
    return Path(cfg.out) / f".spans-rank{rank}.json"


class _Job(ps.Observer):
    """The server's side of the job: what a data-parallel run's rank 0 prints and keeps."""

    def __init__(self, cfg: TrainConfig, world: World, per_epoch: int, steps: int,
                 task: ps.Task, state: dict | None, on_step) -> None:
        self.cfg, self.world, self.task, self.on_step = cfg, world, task, on_step
        self.per_epoch, self.steps = per_epoch, steps
        self.servers = cfg.servers
        self.workers = world.world_size - cfg.servers
        self.deferred: tuple | None = None  # a sharded run's last epoch, scored at the end
        self.out = Path(cfg.out)
        saved = state["job"] if state else {}
        self.step = int(state["step"]) if state else 0
        self.saved_at = self.step if state else -1
        self.interval = list(saved.get("interval", [0.0, 0]))  # loss sum, samples
        self.epoch_loss = list(saved.get("epoch_loss", [0.0, 0]))
        self.lost_rows: list[dict] = list(saved.get("lost", []))
        self.rep = Reporter(self.out, True, self.step if state else None)
        self.log_every = cfg.log_every or max(1, per_epoch // 5)
        self.fresh, self.last_log, self.epoch_t0 = 0, time.perf_counter(), time.perf_counter()
        self.evaluated: tuple[float, float] = (math.nan, math.nan)
        self.trace_stats: dict | None = None
        self.server: ps.Server | None = None  # set by train() before the server runs
        self._say_start(state)

    def _say_start(self, state: dict | None) -> None:
        cfg, w = self.cfg, self.workers
        slow = ps.parse_straggler(cfg.straggler)
        self.rep.say(f"microddp train: {w + 1} ranks (gloo, cpu), strategy async: a parameter "
                     f"server (rank 0) and {w} worker(s), "
                     f"{ps.describe(ps.parse_staleness(cfg.staleness), cfg.backup_workers)}"
                     + (", staleness-aware lr" if cfg.staleness_lr else "")
                     + "".join(f", rank {r} x{f:g} slower" for r, f in slow.items())
                     + f"; {cfg.dataset}: {len(self.task.train)} train / "
                     f"{len(self.task.test)} test samples")
        self.rep.say(f"batch {cfg.batch_size} global, shared by {w} worker(s); {cfg.optimizer} "
                     f"lr {cfg.learning_rate:g}; {self.per_epoch} steps x {cfg.epochs} epochs "
                     "(a step: one global batch's worth of gradients applied)")
        if state:
            self.rep.say(f"resuming from {Path(state['path']).name}: step {self.step}, "
                         f"{state['ps']['updates']} updates applied")

    # ---- what the server tells us ---------------------------------------------------------
    def updated(self, server: ps.Server, used: list[ps.Held]) -> None:
        for g in used:
            for acc in (self.interval, self.epoch_loss):
                acc[0] += g.loss
                acc[1] += g.samples
            self.fresh += g.samples
        new = min(self.steps, server.report.applied // self.workers)
        crossed = range(self.step + 1, new + 1)
        if not crossed:
            return
        self.step = new
        if any(s % self.log_every == 0 or s % self.per_epoch == 0 for s in crossed):
            self._progress(server)
        if self.on_step is not None:
            self.on_step(self.step)
        for s in crossed:
            if s % self.per_epoch == 0:
                self._epoch_end(server, s // self.per_epoch)
        # after the epoch's end: a run resumed from here starts the next epoch afresh
        if self.cfg.checkpoint_every and any(s % self.cfg.checkpoint_every == 0
                                             for s in crossed):
            self.save(server)

    def lost(self, server: ps.Server, worker: int, reason: str) -> None:
        row = {"kind": "lost", "step": self.step, "rank": worker,
               "version": server.ssp.version, "reason": reason}
        self.lost_rows.append(row)
        self.rep.log(row)
        self.rep.say(f"worker rank {worker} lost at step {self.step} (update "
                     f"{server.ssp.version}): {reason}; going on with {len(server.live)} "
                     "worker(s)")

    # ---- progress, epochs, checkpoints -----------------------------------------------------
    def _progress(self, server: ps.Server) -> None:
        loss = self.interval[0] / max(self.interval[1], 1)
        now = time.perf_counter()
        rate = self.interval[1] / max(now - self.last_log, 1e-9)
        r, epoch = server.report, (self.step - 1) // self.per_epoch
        done = self.step - epoch * self.per_epoch
        stale = r.staleness[-200:]
        self.rep.say(f"epoch {epoch + 1}/{self.cfg.epochs} {bar(done, self.per_epoch)} "
                     f"{done}/{self.per_epoch} steps  step {self.step}  loss {loss:.4f}  "
                     f"{rate:,.0f} samples/s  {r.updates} updates, staleness mean "
                     f"{sum(stale) / max(len(stale), 1):.2f} max {max(stale, default=0)}")
        self.rep.log({"kind": "step", "step": self.step, "epoch": epoch + 1, "loss": loss,
                      "samples_per_s": rate, "lr": server.opt.param_groups[0]["lr"],
                      "updates": r.updates})
        self.interval, self.last_log = [0.0, 0], now

    def _epoch_end(self, server: ps.Server, epochs_done: int) -> None:
        seconds = time.perf_counter() - self.epoch_t0
        train_loss = self.epoch_loss[0] / max(self.epoch_loss[1], 1)
        rate = self.fresh / max(seconds, 1e-9)
        if self.servers > 1:
            if self.step >= self.steps:  # the other shards arrive when their servers end
                self.deferred = (epochs_done, train_loss, rate, seconds, server.report.updates)
                return
            _receive_shards(server, self.cfg.servers)
        self.evaluated = ps.score(server.model, self.task.test)
        self._epoch_row(server.report.updates, epochs_done, train_loss, rate, seconds)
        if not self.cfg.checkpoint_every:
            self.save(server)

    def _epoch_row(self, updates: int, epochs_done: int, train_loss: float, rate: float,
                   seconds: float) -> None:
        self.rep.epoch_summary(epochs_done - 1, self.cfg.epochs, train_loss, self.evaluated[1],
                               rate, seconds)
        self.rep.log({"kind": "epoch", "step": self.step, "epoch": epochs_done,
                      "train_loss": train_loss, "test_loss": self.evaluated[0],
                      "test_accuracy": self.evaluated[1], "samples_per_s": rate,
                      "updates": updates})
        self.epoch_loss, self.fresh, self.epoch_t0 = [0.0, 0], 0, time.perf_counter()

    def save(self, server: ps.Server) -> None:
        if self.saved_at == self.step:
            return
        cfg, epoch = self.cfg, self.step // self.per_epoch
        position = self.step - epoch * self.per_epoch
        state = {"format": checkpoint.FORMAT, "model": server.model.state_dict(),
                 "optimizer": server.opt.state_dict(), "step": self.step, "epoch": epoch,
                 "position": position,
                 "sampler": {"epoch": epoch, "position": position, "seed": cfg.seed,
                             "n": len(self.task.train), "batch_size": cfg.batch_size},
                 "rng": [checkpoint.rng_state()], "world_size": self.world.world_size,
                 "config": cfg.resume_settings(), "ps": server.state_dict(),
                 "job": {"interval": self.interval, "epoch_loss": self.epoch_loss,
                         "lost": self.lost_rows}}
        try:
            checkpoint.save(state, cfg.ckpt_dir, self.step, cfg.keep)
        except OSError as e:
            path = checkpoint.path_for(cfg.ckpt_dir, self.step)
            raise MicroDDPError(f"cannot write checkpoint {path}: {e.strerror or e}; free space "
                                "or pick another --checkpoint-dir") from None
        self.saved_at = self.step

    # ---- the end -------------------------------------------------------------------------
    def finish(self, report: ps.ServerReport) -> None:
        """The last checkpoint, the merged trace, model.pt, the final record, the curves."""
        model = self.task.make_model()
        model.load_state_dict(report.state)  # with several servers, gathered by server 0
        self.evaluated = ps.score(model, self.task.test)
        if self.deferred:
            epochs_done, train_loss, rate, seconds, updates = self.deferred
            self._epoch_row(updates, epochs_done, train_loss, rate, seconds)
        self.save(self.server)
        stats = self._merge_trace(report) if self.cfg.trace else None
        self.trace_stats = stats
        out, rep = self.out, self.rep
        with outputs.atomic(out / "model.pt") as tmp:
            torch.save(report.state, tmp)
        hist = report.histogram
        rep.log({"kind": "final", "step": self.step, "test_accuracy": self.evaluated[1],
                 "test_loss": self.evaluated[0], "samples_per_s": report.samples_per_s,
                 "strategy": "async", "staleness": self.cfg.staleness,
                 "backup_workers": self.cfg.backup_workers, "updates": report.updates,
                 "gradients_applied": report.applied, "gradients_discarded": report.discarded,
                 "staleness_histogram": {str(k): v for k, v in hist.items()},
                 "mean_staleness": sum(report.staleness) / max(len(report.staleness), 1),
                 "lost": [{k: r[k] for k in ("rank", "step", "version", "reason")}
                          for r in self.lost_rows],
                 "memory": self._memory(model), **({"trace": stats} if stats else {})})
        png = plot_curves(rep.metrics_path, out / "curves.png") if self.cfg.plot else None
        ckpts = self.cfg.ckpt_dir
        files = [out / "model.pt", rep.metrics_path, png,
                 *((stats["trace_json"], stats["timeline_png"]) if stats else ()),
                 f"{ckpts}/" if ckpts.is_dir() and any(ckpts.iterdir()) else None]
        rep.say(f"staleness of the {report.applied} applied gradients: "
                + ", ".join(f"{s}: {c}" for s, c in hist.items())
                + f"; {report.updates} updates, {report.samples_per_s:,.0f} samples/s"
                + (f"; lost workers: {', '.join(str(r['rank']) for r in self.lost_rows)}"
                   if self.lost_rows else ""))
        rep.say(f"done: test accuracy {100 * self.evaluated[1]:.2f}% after {self.step} steps; "
                + outputs.wrote(files))
        if stats:
            rep.say(trace_report.format_summary(stats))

    def _memory(self, model: torch.nn.Module) -> list[dict]:
        """Bytes per rank: a server holds the parameters (all of them: it builds the whole
        model), its shard's averaged gradient and optimizer state; a worker parameters and its
        gradients. sent_per_step: per global batch's worth, a server sends each worker its
        shard once per gradient, a worker one gradient (plus its loss) to each server; every
        message with its 40-byte header."""
        from ...ps.flat import HEADER_BYTES, cuts

        numel = sum(p.numel() for p in model.parameters())
        sizes = [p.numel() for p in model.parameters()]
        starts = [0, *cuts(sizes, self.servers), len(sizes)]
        shard = [sum(sizes[a:b]) for a, b in zip(starts, starts[1:], strict=False)]
        opt = self.server.opt.state_dict()["state"] if self.server else {}
        opt_bytes = sum(t.numel() * t.element_size() for s in opt.values() for t in s.values()
                        if torch.is_tensor(t))
        # server 0's optimizer state per element, the same on every shard (sgd, adam: per
        # element)
        servers = [{"rank": r, "params": 4 * numel, "grads": 4 * shard[r],
                    "optimizer_state": round(opt_bytes * shard[r] / shard[0]),
                    "sent_per_step": (HEADER_BYTES + 4 * shard[r]) * self.workers}
                   for r in range(self.servers)]
        worker_sent = sum(HEADER_BYTES + 4 * (n + 1) for n in shard)
        return servers + [{"rank": r, "params": 4 * numel, "grads": 4 * (numel + self.servers),
                           "optimizer_state": 0, "sent_per_step": worker_sent}
                          for r in range(self.servers, self.servers + self.workers)]

    def _merge_trace(self, report: ps.ServerReport) -> dict:
        """The server's spans and every finished worker's (from the files they leave: a lost
        worker has none) into trace.json, timeline.png and the summary."""
        by_rank = {0: trace_report.to_wall(spans.stop())}
        lost = {w for w, _ in report.lost}
        for rank in range(1, self.workers + 1):
            path, deadline = _spans_file(self.cfg, rank), time.monotonic() + TRACE_WAIT_S
            while rank not in lost and not path.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            if path.exists():
                by_rank[rank] = [spans.Span(**s) for s in json.loads(path.read_text())]
                path.unlink()
        return trace_report.write(by_rank, self.out)
