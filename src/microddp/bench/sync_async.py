"""Synchronous against asynchronous training, measured: `microddp bench async`.

One set of W+1 ranks runs every configuration in turn: sync dp (W ranks of microddp's DDP; rank
0 waits), and a parameter server (rank 0) with W workers at staleness 0, with backup workers,
under SSP at a few bounds S, and fully asynchronous; each without and with one worker FACTOR
times slower. Every run trains the same model from the same weights on the same number of
samples (STEPS global batches), and keeps a timestamped copy of the parameters every few
steps; after the run, outside the timing, the copies are scored on the test set: test accuracy
against wall-clock time. The runs of a round go in a fresh random order (the same on every
rank), --rounds times, so a burst of load on this shared machine hits every configuration.
Reported: samples/s (median over rounds) and its ratio to sync dp's, test accuracy, the time to
reach --target, the staleness histograms.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import comms, flags, monitor, outputs, ps
from ..data import load_dataset
from ..dp import DistributedDataParallel
from ..errors import MicroDDPError
from ..launch.spawn import spawn
from ..model import FullMLP
from ..ps.protocol import flat_params, load_flat
from ..timing import straggle_after_forward

EPILOG = """\
examples:
  microddp bench async                              # 2 workers, 150 steps, 3 rounds (minutes)
  microddp bench async --steps 20 --rounds 1 --bounds 2 --out runs/bench-async-quick
  microddp bench async --workers 3 --bounds 1 2 8 --straggler-factor 8
writes async.json (every run, its curve and histogram) and async.png (the curves) into a new
runs/bench-async-DATE-TIME, or --out.
"""


@dataclass(frozen=True)
class Setup:
    """One configuration: sync dp (`dp`), or the server at staleness `bound` with `backups`."""

    name: str
    dp: bool = False
    bound: float = 0
    backups: int = 0


def setups(bounds: list[int], backups: int) -> list[Setup]:
    """The runs of one round: sync dp, the server at staleness 0 (and with backup workers), SSP at each bound, fully async."""
    # sync dp twice: the second is the A/A control, its ratio to the first the noise floor
    out = [Setup("sync dp", dp=True), Setup("sync dp (A/A)", dp=True), Setup("ps S=0", bound=0)]
    if backups:
        out.append(Setup(f"ps S=0, {backups} backup", bound=0, backups=backups))
    out += [Setup(f"ps SSP S={s}", bound=s) for s in bounds]
    return out + [Setup("ps async", bound=math.inf)]


def _task(hidden: int, depth: int, batch: int) -> ps.Task:
    data = load_dataset("digits")

    def make_model() -> torch.nn.Module:
        torch.manual_seed(0)
        return FullMLP(hidden, depth, n_classes=data.n_classes, in_features=data.in_features)

    return ps.Task(make_model, data.train, batch, data.test, seed=1)


class _Snapshots(ps.Observer):
    """The server's parameters every `every` steps' worth of gradients, with the time."""

    def __init__(self, every: int, workers: int, first: torch.Tensor) -> None:
        self.every, self.workers, self.kept = every, workers, [(0.0, 0, first)]

    def updated(self, server: ps.Server, used: list[ps.Held]) -> None:
        step = server.report.applied // self.workers
        if step // self.every > self.kept[-1][1] // self.every:
            # a copy: the server steps its parameters in place
            self.kept.append((time.perf_counter() - server.start, step, server.params.clone()))


def _ps_run(world, task: ps.Task, setup: Setup, s: dict, slow: dict[int, float]) -> dict | None:
    config = ps.PSConfig(steps=s["steps"], lr=s["lr"], staleness=setup.bound,
                         backup_workers=setup.backups, stragglers=slow, servers=s["servers"])
    if world.rank >= config.servers:
        ps.run_worker(world.rank, world.world_size, task, config)
        return None
    if world.rank != ps.SERVER:
        ps.run_server(world.world_size, task, config, rank=world.rank)
        return None
    workers = world.world_size - config.servers
    snaps = _Snapshots(s["eval_every"], workers, flat_params(task.make_model()))
    # with several servers, server 0 holds only its shard until the end: the curve is the
    # first and the last parameters only
    report = ps.Server(world.world_size, task, config,
                       snaps if config.servers == 1 else None).run()
    kept = snaps.kept
    if config.servers > 1:
        model = task.make_model()
        model.load_state_dict(report.state)
        kept.append((report.seconds, report.applied // workers, flat_params(model)))
    return {"samples": report.samples, "seconds": report.seconds, "updates": report.updates,
            "histogram": report.histogram, "discarded": report.discarded, "snapshots": kept}


def _dp_run(world, group, task: ps.Task, s: dict, slow: dict[int, float]) -> dict | None:
    """W ranks of microddp's DDP on the same global batches; the straggler sleeps as
    `microddp train --straggler` makes it (timing.straggle_after_forward)."""
    first = s["servers"]  # sync dp runs on the workers' ranks; the servers' ranks wait
    if world.rank < first:
        return None
    model = task.make_model()
    ddp = DistributedDataParallel(model, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=s["lr"])
    part, parts, factor = world.rank - first, world.world_size - first, slow.get(world.rank, 1.0)
    kept, samples = [(0.0, 0, flat_params(model))], 0
    start = time.perf_counter()
    for step in range(s["steps"]):
        batch = task.batch(step)
        idx = task.indices(step, part, parts)
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        logits = ddp(task.train.x[idx])
        straggle_after_forward(time.perf_counter() - t0, factor)
        loss = F.cross_entropy(logits, task.train.y[idx], reduction="sum") * parts / len(batch)
        loss.backward()
        opt.step()
        samples += len(batch)
        if (step + 1) % s["eval_every"] == 0:
            kept.append((time.perf_counter() - start, step + 1, flat_params(model)))
    seconds = time.perf_counter() - start
    return None if world.rank != first else {
        "samples": samples, "seconds": seconds, "updates": s["steps"], "histogram": {0: 0},
        "discarded": 0, "snapshots": kept}


def _score(task: ps.Task, snapshots: list) -> list[tuple[float, int, float]]:
    """(seconds, step, test accuracy) of every kept copy of the parameters."""
    model = task.make_model()
    curve = []
    for t, step, flat in snapshots:
        load_flat(model, flat)
        curve.append((round(t, 4), step, round(ps.score(model, task.test)[1], 4)))
    return curve


def _rank(world, plan: list[tuple[int, int, bool]], all_setups: list[Setup], s: dict) -> list:
    """Every run of the plan on this rank; the rank that measured a run keeps its numbers."""
    torch.set_num_threads(1)  # ranks share the cores: one thread each keeps runs comparable
    monitor.disable()  # a parameter server waits on point-to-point messages, not collectives
    group = comms.new_group(list(range(s["servers"], world.world_size)))  # sync dp's ranks
    task = _task(s["hidden"], s["depth"], s["batch_size"])
    out = []
    for round_, k, straggling in plan:
        setup = all_setups[k]
        slow = {world.world_size - 1: s["factor"]} if straggling else {}
        comms.barrier()  # every run starts together, after the last one fully ended
        r = (_dp_run(world, group, task, s, slow) if setup.dp else
             _ps_run(world, task, setup, s, slow))
        if r is not None:
            r["curve"] = _score(task, r.pop("snapshots"))
            out.append({"setup": setup.name, "straggler": straggling, "round": round_, **r})
    return out


def measure(s: dict) -> list[dict]:
    """Every run of every configuration, `rounds` times, interleaved; one dict per run."""
    all_setups = setups(s["bounds"], s["backup_workers"])
    order = random.Random(0)
    plan = []
    for round_ in range(s["rounds"]):
        runs = [(k, st) for k in range(len(all_setups)) for st in (False, True)]
        plan += [(round_, k, st) for k, st in order.sample(runs, len(runs))]
    per_rank = spawn(_rank, s["workers"] + s["servers"], (plan, all_setups, s), backend="gloo",
                     timeout=s["deadline"])
    return [run for runs in per_rank for run in runs]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `microddp bench async`."""
    a = p.add_argument
    a("--workers", type=int, default=2, help="workers: sync dp runs on as many ranks, the "
      "parameter server adds one (default 2)")
    a("--servers", type=int, default=1, help="parameter servers, each holding a shard of the "
      "parameters; sync dp runs on the workers' ranks alone (default 1)")
    a("--steps", type=int, default=150, help="global batches per run (default 150)")
    a("--batch-size", type=int, default=64, help="global batch (default 64)")
    a("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    a("--hidden", type=int, default=256, help="FullMLP width (default 256)")
    a("--depth", type=int, default=3, help="FullMLP hidden layers (default 3)")
    a("--bounds", type=int, nargs="+", default=[1, 4], help="SSP staleness bounds to run "
      "besides 0 and inf (default 1 4)")
    a("--backup-workers", type=int, default=1, help="backup workers of the synchronous "
      "server run; 0 leaves that run out (default 1)")
    a("--straggler-factor", type=float, default=4.0, help="how many times slower the last "
      "worker computes in the straggler runs (default 4)")
    a("--rounds", type=int, default=3, help="passes over all configurations (default 3)")
    a("--eval-every", type=int, default=10, help="steps between the kept copies of the "
      "parameters scored for the accuracy curve (default 10)")
    a("--target", type=float, default=0.9, help="test accuracy whose time to reach is "
      "reported (default 0.9)")
    a("--out", default=None, help="folder for async.json and async.png (default: a new "
      "runs/bench-async-DATE-TIME)")


def run(args: argparse.Namespace) -> int:
    """Run every configuration --rounds times, interleaved, with and without a straggler; print and save the report."""
    from .sync_async_report import report

    flags.at_least(2, workers=args.workers)
    flags.at_least(1, servers=args.servers)
    flags.at_least(1, steps=args.steps, rounds=args.rounds, eval_every=args.eval_every,
                   bounds=args.bounds, hidden=args.hidden, batch_size=args.batch_size)
    flags.at_least(0, depth=args.depth, backup_workers=args.backup_workers)
    flags.positive("lr", args.lr)
    flags.distinct("bounds", args.bounds)
    if args.backup_workers >= args.workers:
        raise MicroDDPError(f"--backup-workers {args.backup_workers} must be below --workers "
                            f"{args.workers}: an update needs at least one gradient")
    if not (math.isfinite(args.straggler_factor) and args.straggler_factor >= 1):
        raise MicroDDPError(f"--straggler-factor must be a finite number >= 1, got "
                            f"{args.straggler_factor}")
    if not 0 < args.target <= 1:
        raise MicroDDPError(f"--target is a test accuracy in (0, 1], got {args.target}")
    if args.batch_size < args.workers:
        raise MicroDDPError(f"--batch-size {args.batch_size} is shared by {args.workers} "
                            f"workers: use at least {args.workers}")
    s = {"workers": args.workers, "servers": args.servers, "steps": args.steps, "batch_size": args.batch_size,
         "lr": args.lr, "hidden": args.hidden, "depth": args.depth, "bounds": args.bounds,
         "backup_workers": args.backup_workers, "factor": args.straggler_factor,
         "rounds": args.rounds, "eval_every": args.eval_every, "target": args.target}
    runs = len(setups(args.bounds, args.backup_workers)) * 2 * args.rounds
    s["deadline"] = 300 + 2.0 * runs * args.steps  # generous: a busy 2-core machine
    with outputs.run_folder(args.out, "bench-async") as out:
        load = os.getloadavg()
        print(f"{args.workers} workers (+{args.servers} server(s); sync dp on the "
              f"{args.workers} workers' ranks alone), {runs} runs of {args.steps} global batches "
              f"of {args.batch_size}, {args.rounds} round(s); load average {load[0]:.2f} on "
              f"{os.cpu_count()} cores", flush=True)
        return report(measure(s), s, out, load)
