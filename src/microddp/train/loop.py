"""The training procedure every rank runs: one readable loop from data to checkpoint.

Each optimizer step covers one window of `accumulate` global batches. The loss of a rank's
slice is its *sum* times world_size / (samples in the window), so once the engine averages
gradients over ranks the step is exactly the mean over the window's samples — however the
samples were split over ranks and micro-batches, and also for an uneven last batch.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import checkpoint, monitor, outputs
from .. import spans as trace
from ..comms.world import World, distributed
from ..data import ShardedBatchSampler, evaluate, load_dataset
from ..ps import parse_straggler
from ..timing import straggle_after_forward
from ..trace import report as trace_report
from . import resume
from .build import Hook, Precision, bare, build_model, build_optimizer, wrap
from .config import TrainConfig, validate
from .report import LossMeter, Reporter, plot_curves


@dataclass
class Result:
    """What a finished run returns on every rank (tests compare `params` across runs)."""

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


def _micro_step(model, precision: Precision, x: torch.Tensor, y: torch.Tensor, scale: float,
                sync: bool, slow: float = 1.0) -> torch.Tensor:
    """Forward and backward of one micro-batch; returns its summed loss.

    Both run inside no_sync() when `sync` is False: DDP decides at forward time whether the
    coming backward averages gradients. `slow` > 1 (--straggler): this rank sleeps so that its
    forward and backward take `slow` times as long.
    """
    with contextlib.nullcontext() if sync else model.no_sync():
        t0 = time.perf_counter()
        with trace.span("forward"), precision.autocast():
            logits = model(x)
        if slow > 1:
            with trace.span("straggle"):
                straggle_after_forward(time.perf_counter() - t0, slow)
        loss_sum = F.cross_entropy(logits.float(), y, reduction="sum")
        with trace.span("backward"):
            precision.backward(loss_sum * scale)
    return loss_sum


def train(world: World, cfg: TrainConfig, on_step: Hook | None = None) -> Result:
    """Run (or continue) the training job described by `cfg` on this rank."""
    if cfg.strategy == "async":  # a parameter server and its workers: train/async_job.py
        from .async_job import train as train_async

        done = train_async(world, cfg, on_step)
        return done and Result(**done)
    validate(cfg, world.world_size)
    out = Path(cfg.out)
    device = world.device
    data = load_dataset(cfg.dataset)
    train_set, test_set = data.train.to(device), data.test.to(device)
    module = build_model(cfg, data.in_features, data.n_classes, device)
    model = wrap(module, cfg.engine, world)
    optimizer = build_optimizer(cfg, model.parameters())
    precision = Precision(cfg.amp, device)
    # Empty shards are allowed: a loss scaled by the step's sample count handles them exactly.
    sampler = ShardedBatchSampler(len(train_set), cfg.batch_size, world.rank, world.world_size,
                                  seed=cfg.seed, allow_empty=True)
    if cfg.trace:
        trace.start()
    # On by default because it is cheap: a stalled collective names every rank's line.
    if distributed() and cfg.monitor_timeout:
        monitor.enable(timeout=cfg.monitor_timeout)
    elif not cfg.monitor_timeout:  # off means off: also the one init() may have started
        monitor.disable()
    drift = monitor.DriftCheck(bare(model), every=cfg.drift_every) if cfg.drift_every else None

    state = resume.find(cfg, world)
    step = resume.restore(state, world, module, optimizer, precision, sampler) if state else 0
    rep = Reporter(out, world.rank == 0, step if state else None)
    per_rank = cfg.batch_size // world.world_size
    slow = parse_straggler(cfg.straggler).get(world.rank, 1.0)
    steps_per_epoch = math.ceil(len(sampler) / cfg.accumulate)
    rep.say(f"microddp train: {world.world_size} rank(s) ({world.backend or 'single process'}, "
            f"{device}), engine {cfg.engine if distributed() else 'none'}, "
            f"{cfg.dataset}: {len(train_set)} train / "
            f"{len(test_set)} test samples")
    rep.say(f"batch {cfg.batch_size} global = {per_rank} per rank x {world.world_size}"
            + (f", accumulate {cfg.accumulate} -> {cfg.batch_size * cfg.accumulate} samples "
               "per step" if cfg.accumulate > 1 else "")
            + f"; {cfg.optimizer} lr {cfg.learning_rate:g}; {steps_per_epoch} steps x "
            f"{cfg.epochs} epochs" + (f"; amp {cfg.amp}" if cfg.amp else ""))
    if state:
        rep.say(resume.describe(state, world))

    meter = LossMeter(device)

    def make_state() -> dict:
        return {"format": checkpoint.FORMAT, "model": bare(model).state_dict(),
                "optimizer": optimizer.state_dict(), "scaler": precision.state_dict(),
                "step": step, "epoch": sampler.epoch, "position": sampler.position,
                "sampler": sampler.state_dict(), "world_size": world.world_size,
                "config": cfg.resume_settings(), **meter.state()}

    saved_at = step if state else -1

    def save() -> None:
        nonlocal saved_at
        if saved_at != step:
            meter.sync()  # the loss sums so far travel with the checkpoint
            checkpoint.save_from_rank0(make_state, cfg.ckpt_dir, step, world, cfg.keep)
            saved_at = step

    log_every = cfg.log_every or max(1, steps_per_epoch // 5)
    first_epoch = sampler.epoch + (1 if sampler.position >= len(sampler) else 0)
    evaluated: dict = {}
    stopped = False
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
                with trace.span("data", track="data"):
                    idx = torch.as_tensor(next(batches), dtype=torch.long, device=device)
                    x, y = train_set.x[idx], train_set.y[idx]
                # Only the window's last micro-batch synchronises: the others just accumulate.
                loss_sum = _micro_step(model, precision, x, y, world.world_size / total,
                                       sync=k == len(window) - 1, slow=slow)
                meter.add(loss_sum, len(y))
            with trace.span("optimizer", track="optim"):
                precision.step(optimizer)
                optimizer.zero_grad(set_to_none=True)
            step += 1
            trace.next_step()
            if drift is not None:
                drift.check(step)
            last = w == len(windows) - 1
            done = math.ceil(window.stop / cfg.accumulate)  # optimizer steps into this epoch
            if done % log_every == 0 or last:
                meter.sync()  # every rank reaches this line at the same steps
                loss, n = meter.take_interval()
                now = time.perf_counter()
                rate = n / max(now - last_log, 1e-9)
                rep.progress(epoch, cfg.epochs, done, steps_per_epoch, step, loss, rate)
                rep.log({"kind": "step", "step": step, "epoch": epoch + 1, "loss": loss,
                         "samples_per_s": rate, "lr": optimizer.param_groups[0]["lr"]})
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
        evaluated = evaluate(bare(model), test_set, world)
        rate = meter.fresh / max(epoch_time, 1e-9)
        rep.epoch_summary(epoch, cfg.epochs, meter.epoch_mean(), evaluated["accuracy"], rate,
                          epoch_time)
        rep.log({"kind": "epoch", "step": step, "epoch": epoch + 1,
                 "train_loss": meter.epoch_mean(), "test_loss": evaluated["loss"],
                 "test_accuracy": evaluated["accuracy"], "samples_per_s": rate})
        if not cfg.checkpoint_every:
            save()
    save()
    if not evaluated or stopped:
        evaluated = evaluate(bare(model), test_set, world)
        rep.say(f"stopped after step {step}: test accuracy {100 * evaluated['accuracy']:.2f}%")
    return _finish(world, cfg, model, out, rep, step, evaluated, state)


def _finish(world: World, cfg: TrainConfig, model, out: Path, rep: Reporter, step: int,
            evaluated: dict, state: dict | None) -> Result:
    """model.pt, the curves, the trace summary; then the result every rank returns."""
    monitor.disable()
    stats = trace_report.finish(out, world) if cfg.trace else None
    if world.rank == 0:
        tmp = out / ".model.pt.tmp"
        torch.save(bare(model).state_dict(), tmp)
        tmp.replace(out / "model.pt")
        rep.log({"kind": "final", "step": step, "test_accuracy": evaluated["accuracy"],
                 "test_loss": evaluated["loss"], **({"trace": stats} if stats else {})})
        png = plot_curves(rep.metrics_path, out / "curves.png") if cfg.plot else None
        if cfg.plot and png is None:
            rep.say("no curves.png: matplotlib is not installed (pip install 'microddp[train]')")
        ckpts = cfg.ckpt_dir if cfg.ckpt_dir.is_dir() and any(cfg.ckpt_dir.iterdir()) else None
        files = [out / "model.pt", rep.metrics_path, png,
                 *((stats["trace_json"], stats["timeline_png"]) if stats else ()),
                 f"{ckpts}/" if ckpts else None]
        rep.say(f"done: test accuracy {100 * evaluated['accuracy']:.2f}% after {step} steps; "
                + outputs.wrote(files))
        if stats:
            rep.say(trace_report.format_summary(stats))
    params = {k: v.detach().cpu().clone() for k, v in bare(model).state_dict().items()}
    return Result(step, evaluated["accuracy"],
                  evaluated["loss"], out, params, state["path"] if state else None, stats)
