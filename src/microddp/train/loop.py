"""The training procedure every rank runs: one readable loop from data to checkpoint.

Each optimizer step covers one window of `accumulate` global batches. The loss of a rank's
slice is its *sum* times replicas / (samples in the window), so once the strategy averages
gradients over its replicas the step is exactly the mean over the window's samples — however
the samples were split over ranks and micro-batches, and also for an uneven last batch.

How the model is spread over the ranks is the strategy's business (train/strategies/): the
loop asks it for one micro-step, the optimizer step, evaluation, checkpoints and model.pt.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import checkpoint, monitor, outputs, spans
from ..data import ShardedBatchSampler, load_dataset
from ..errors import MicroDDPError
from ..trace import report as trace_report
from ..transport.objects import all_gather_values
from ..world.world import World, distributed
from . import resume, sharded, strategies
from .build import Hook, Precision, build_model
from .config import TrainConfig
from .report import LossMeter, Reporter, plot_curves
from .strategies.base import Strategy
from .validate import validate


@dataclass
class Result:
    """What a finished run returns on every rank (tests compare `params` across runs):
    `params` is the whole model on rank 0, a rank's own replica elsewhere (dp), else empty."""

    step: int
    test_accuracy: float
    test_loss: float
    out: Path
    params: dict[str, torch.Tensor] = field(repr=False)
    resumed_from: str | None = None
    trace: dict | None = None


def _window_plan(n_batches: int, first: int, accumulate: int) -> list[range]:
    """Micro-batch indices of each optimizer step in an epoch, starting at batch `first`."""
    return [range(i, min(i + accumulate, n_batches)) for i in range(first, n_batches, accumulate)]


def train(world: World, cfg: TrainConfig, on_step: Hook | None = None) -> Result:
    """Run (or continue) the training job described by `cfg` on this rank."""
    validate(cfg, world.world_size)
    if strategies.entry(cfg.strategy).own_loop:  # async: a parameter server and its workers
        done = strategies.implementation(cfg.strategy).train(world, cfg, on_step)
        return done and Result(**done)
    out = Path(cfg.out)
    device = world.device
    data = load_dataset(cfg.dataset)
    train_set, test_set = data.train.to(device), data.test.to(device)
    if cfg.batch_size * cfg.accumulate > len(train_set):  # a step would use samples twice
        raise MicroDDPError(f"--batch-size {cfg.batch_size}"
                            + (f" x --accumulate {cfg.accumulate}" if cfg.accumulate > 1 else "")
                            + f" is more than the {len(train_set)} training samples of "
                            f"{cfg.dataset}; one step can use each sample once: use at most "
                            f"{len(train_set)} samples per step")
    module = build_model(cfg, data.in_features, data.n_classes, device)
    precision = Precision(cfg.amp, device)
    strategy = strategies.make(cfg, world, module, precision)
    # Empty shards are allowed: a loss scaled by the step's sample count handles them exactly.
    sampler = ShardedBatchSampler(len(train_set), cfg.batch_size, strategy.data_rank,
                                  strategy.data_size, seed=cfg.seed, allow_empty=True)
    if cfg.trace:
        spans.start()
    # On by default because it is cheap: a stalled collective names every rank's line.
    if distributed() and cfg.monitor_timeout:
        monitor.enable(timeout=cfg.monitor_timeout)
    elif not cfg.monitor_timeout:  # off means off: also the one init() may have started
        monitor.disable()
    drifting = strategy.drift_module() if cfg.drift_every else None
    drift = monitor.DriftCheck(drifting, every=cfg.drift_every) if drifting else None

    state = resume.find(cfg, world)
    step = resume.restore(state, world, strategy, precision, sampler) if state else 0
    # Sharded checkpoints carry the run's name, so shards of another run are never mixed in.
    run_id = (state["run"] if state and "run" in state else sharded.new_run_id(world)
              if strategy.sharded_checkpoints else None)
    rep = Reporter(out, world.rank == 0, step if state else None)
    replicas = strategy.data_size
    per_rank = cfg.batch_size // replicas
    steps_per_epoch = math.ceil(len(sampler) / cfg.accumulate)
    rep.say(f"microddp train: {world.world_size} rank(s) ({world.backend or 'single process'}, "
            f"{device}), strategy {strategy.describe()}, "
            f"{cfg.dataset}: {len(train_set)} train / "
            f"{len(test_set)} test samples")
    who = "rank" if replicas == world.world_size else "replica"
    rep.say(f"batch {cfg.batch_size} global = {per_rank} per {who} x {replicas}"
            + (f", accumulate {cfg.accumulate} -> {cfg.batch_size * cfg.accumulate} samples "
               "per step" if cfg.accumulate > 1 else "")
            + f"; {cfg.optimizer} lr {cfg.learning_rate:g}; {steps_per_epoch} steps x "
            f"{cfg.epochs} epochs" + (f"; amp {cfg.amp}" if cfg.amp else ""))
    if state:
        rep.say(resume.describe(state, world))

    meter = LossMeter(device)

    def common_state() -> dict:
        """What every strategy's checkpoint holds besides the model and optimizer state."""
        return {"format": checkpoint.FORMAT, "scaler": precision.state_dict(),
                "step": step, "epoch": sampler.epoch, "position": sampler.position,
                "sampler": sampler.state_dict(), "world_size": world.world_size,
                "config": cfg.resume_settings(), **meter.state()}

    saved_at = step if state else -1

    def save() -> None:
        nonlocal saved_at
        if saved_at == step:
            return
        meter.sync()  # the loss sums so far travel with the checkpoint
        if strategy.sharded_checkpoints:  # every rank writes its own part
            folder = checkpoint.path_for(cfg.ckpt_dir, step).with_suffix("")
            strategy.save_shards(folder, run_id, common_state, cfg.keep)
        else:
            checkpoint.save_from_rank0(lambda: {**common_state(), **strategy.state_dict()},
                                       cfg.ckpt_dir, step, world, cfg.keep)
        saved_at = step

    log_every = cfg.log_every or max(1, steps_per_epoch // 5)
    first_epoch = sampler.epoch + (1 if sampler.position >= len(sampler) else 0)
    evaluated: dict = {}
    stopped = False
    logged_step = step  # the step of the last progress line: a bad loss lies after it
    trained, run_t0 = 0, time.perf_counter()  # samples this run trained, for its samples/s
    for epoch in range(first_epoch, cfg.epochs):
        if cfg.max_steps and step >= cfg.max_steps:
            break
        sizes = sampler.global_sizes(epoch)
        first = sampler.position if epoch == sampler.epoch else 0
        batches = iter(sampler)  # continues at (epoch, first): the sampler tracks its place
        meter.new_epoch(state if state and first else None)  # mid-epoch: its sums so far
        epoch_t0 = last_log = time.perf_counter()
        windows = _window_plan(len(sizes), first, cfg.accumulate)
        for w, window in enumerate(windows):
            total = sum(sizes[i] for i in window)
            for k, _ in enumerate(window):
                with spans.span("data", track="data"):
                    idx = torch.as_tensor(next(batches), dtype=torch.long, device=device)
                    x, y = train_set.x[idx], train_set.y[idx]
                # Only the window's last micro-batch synchronises: the others just accumulate.
                loss_sum = strategy.micro_step(x, y, replicas / total,
                                               sync=k == len(window) - 1)
                if loss_sum is not None:  # a pipeline counts each replica's loss once
                    meter.add(loss_sum, len(y))
            strategy.step()
            step += 1
            monitor.set_step(step)  # for `microddp status` (monitor/live.py)
            trained += total
            spans.next_step()
            if drift is not None:
                drift.check(step)
            last = w == len(windows) - 1
            done = math.ceil(window.stop / cfg.accumulate)  # optimizer steps into this epoch
            if done % log_every == 0 or last:
                meter.sync()  # every rank reaches this line at the same steps
                loss, n = meter.take_interval()
                if not math.isfinite(loss):  # the same summed loss on every rank: all stop
                    raise MicroDDPError(
                        f"the training loss became {loss} in steps {logged_step + 1}-{step} "
                        f"(every rank stops here, before a checkpoint keeps it); lower "
                        f"--lr (now {cfg.lr:g}) or look for bad inputs in those batches")
                logged_step = step
                now = time.perf_counter()
                rate = n / max(now - last_log, 1e-9)
                rep.progress(epoch, cfg.epochs, done, steps_per_epoch, step, loss, rate)
                rep.log({"kind": "step", "step": step, "epoch": epoch + 1, "loss": loss,
                         "samples_per_s": rate, "lr": strategy.lr})
                last_log = now
            if on_step is not None:
                on_step(step)
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                save()
            if cfg.max_steps and step >= cfg.max_steps and not last:
                stopped = True
                break
        epoch_time = time.perf_counter() - epoch_t0
        if stopped:
            break
        evaluated = strategy.evaluate(test_set)
        rate = meter.fresh / max(epoch_time, 1e-9)
        rep.epoch_summary(epoch, cfg.epochs, meter.epoch_mean(), evaluated["accuracy"], rate,
                          epoch_time)
        rep.log({"kind": "epoch", "step": step, "epoch": epoch + 1,
                 "train_loss": meter.epoch_mean(), "test_loss": evaluated["loss"],
                 "test_accuracy": evaluated["accuracy"], "samples_per_s": rate})
        if not cfg.checkpoint_every:
            save()
    save()
    samples_per_s = trained / max(time.perf_counter() - run_t0, 1e-9)  # checkpoints, evaluation
    if not evaluated or stopped:
        evaluated = strategy.evaluate(test_set)
        rep.say(f"stopped after step {step}: test accuracy {100 * evaluated['accuracy']:.2f}%")
    return _finish(world, cfg, strategy, out, rep, step, evaluated, state, samples_per_s)


def _memory_per_rank(strategy: Strategy, world: World) -> list[dict]:
    """Every rank's measured bytes at its last optimizer step, on rank 0 (others: [])."""
    mine = {"rank": world.rank, **strategy.memory()}
    if not distributed():
        return [mine]
    out = all_gather_values(mine)
    return out if world.rank == 0 else []


def _finish(world: World, cfg: TrainConfig, strategy: Strategy, out: Path, rep: Reporter,
            step: int, evaluated: dict, state: dict | None, samples_per_s: float) -> Result:
    """model.pt, the curves, the trace summary; then the result every rank returns."""
    full = strategy.full_state_dict()  # every rank takes part; rank 0 gets the whole model
    memory = _memory_per_rank(strategy, world)
    monitor.disable()
    stats = trace_report.finish(out, world) if cfg.trace else None
    if world.rank == 0:
        tmp = out / ".model.pt.tmp"
        torch.save(full, tmp)
        tmp.replace(out / "model.pt")
        rep.log({"kind": "final", "step": step, "test_accuracy": evaluated["accuracy"],
                 "test_loss": evaluated["loss"], "samples_per_s": samples_per_s,
                 "strategy": cfg.strategy, "memory": memory,
                 **({"trace": stats} if stats else {})})
        png = plot_curves(rep.metrics_path, out / "curves.png") if cfg.plot else None
        if cfg.plot and png is None:
            rep.say("no curves.png: matplotlib is not installed (pip install 'microddp[train]')")
        ckpts = cfg.ckpt_dir if cfg.ckpt_dir.is_dir() and any(cfg.ckpt_dir.iterdir()) else None
        files = [out / "model.pt", rep.metrics_path, png,
                 *((stats["trace_json"], stats["timeline_png"], f"{stats['hta_dir']}/")
                   if stats else ()),
                 f"{ckpts}/" if ckpts else None]
        rep.say(f"done: test accuracy {100 * evaluated['accuracy']:.2f}% after {step} steps; "
                + outputs.wrote(files))
        if stats:
            rep.say(trace_report.format_summary(stats))
    held = full if full is not None else strategy.replica_state() or {}
    params = {k: v.detach().cpu().clone() for k, v in held.items()}
    return Result(step, evaluated["accuracy"],
                  evaluated["loss"], out, params, state["path"] if state else None, stats)
