"""Measure this host for the cost model: compute rate, and all-reduce alpha and beta.

`microddp predict --calibrate [--verify 2 4]` runs these, saves the figures as the
'calibrated' hardware preset, and (with --verify) compares predicted with measured step times.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch import nn

from .. import comms
from ..collectives.cost import fit_line
from ..launch.spawn import spawn
from ..model import FullMLP
from ..timing import interleaved
from ..world.world import World, distributed
from .pipeline_costs import PipelineCosts, median_costs
from .pipeline_costs import measure as measure_pipeline
from .step import Hardware, fullmlp, predict, save_calibration

SIZES = [2**k for k in range(10, 24, 2)]  # 1 KiB .. 4 MiB of float32


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                y: torch.Tensor) -> None:
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def host_rates(dim: int, depth: int, batch: int, repeats: int = 20) -> tuple[float, float]:
    """Sustained training FLOP/s and memory bytes/s of the whole host.

    One rank per core works at once, as in a DDP run, and their rates add up: this counts
    the contention between ranks that a single process would not see.
    """
    cores = os.cpu_count() or 1
    rates = spawn(_rate_job, cores, args=(dim, depth, batch, repeats), timeout=300,
                  backend="gloo")
    return sum(r[0] for r in rates), sum(r[1] for r in rates)


def rank_rate(dim: int, depth: int, batch: int, repeats: int = 20) -> float:
    """Training FLOP/s of one rank alone, which gets every core's threads (as `spawn` and
    `microddp run` give a single rank). On CPU it falls well short of `host_rates`: a
    FullMLP's small matrices do not split well over threads."""
    return spawn(_rate_job, 1, args=(dim, depth, batch, repeats), timeout=300,
                 backend="gloo")[0][0]


def _rate_job(world: World, dim: int, depth: int, batch: int,
              repeats: int) -> tuple[float, float]:
    torch.manual_seed(0)
    model = FullMLP(dim, depth)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(batch, dim), torch.randint(0, 2, (batch,))
    grads = torch.randn(sum(p.numel() for p in model.parameters()))
    bucket = torch.empty_like(grads)

    def copies() -> None:  # what a DDP bucket costs: copy in, average, copy out
        bucket.copy_(grads)
        bucket.div_(2)
        grads.copy_(bucket)

    t = interleaved({"step": lambda: _train_step(model, opt, x, y), "copies": copies},
                    repeats, warmup=3)
    flops = fullmlp(dim, depth).flops_per_sample * batch / statistics.median(t["step"])
    return flops, 3 * grads.numel() * 4 / statistics.median(t["copies"])


def _cpu_seconds() -> float:
    """CPU time of this whole process, every thread (gloo's own threads do the sending)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _allreduce_times(world: World, sizes: list[int],
                     repeats: int) -> tuple[list[float], float, str]:
    """Median all-reduce time per size, the CPU-seconds this rank spent per second of
    all-reduce at the largest size (the rest of the time it waited), and the path it took."""
    out = []
    for n in sizes:
        t = torch.ones(n // 4)
        times, cpu = [], 0.0
        for i in range(repeats + 2):
            comms.barrier()
            c0, t0 = _cpu_seconds(), time.perf_counter()
            comms.all_reduce(t)
            if i >= 2:
                times.append(time.perf_counter() - t0)
                cpu += _cpu_seconds() - c0
        out.append(statistics.median(times))
    return out, cpu / sum(times), _path(world)


def fit_alpha_beta(sizes: list[int], times: list[float], world: int) -> tuple[float, float]:
    """Fit t = a + b n to ring all-reduce times, read as a ring: a = 2(N-1) alpha and
    b = 2(N-1)/N / bandwidth. Returns (alpha seconds, bandwidth bytes/s)."""
    a, b = fit_line(sizes, times)
    return max(a, 1e-7) / (2 * (world - 1)), 2 * (world - 1) / world / max(b, 1e-15)


def fit_shm(sizes: list[int], times: list[float], world: int = 2) -> tuple[float, float]:
    """Fit t = a + b n to all-reduce times through shared memory, read as CostModel's
    shm_all_reduce (the reduction folded into beta): on 2 ranks every size up to a slot takes
    one synchronisation and one copy in, a = alpha and b = beta; on more, most of them two
    and a copy in and one out, a = 2 alpha and b = 2 beta. Returns (alpha seconds per
    synchronisation, bytes/s)."""
    a, b = fit_line(sizes, times)
    k = 1 if world == 2 else 2
    return max(a, 1e-7) / k, k / max(b, 1e-15)


def _path(world: World) -> str:
    """"shm" if microddp.comms.all_reduce takes shared memory on this group, else "ring"
    (the cost model the fit is read as)."""
    from ..collectives import route

    return "shm" if route.all_reduce_path(torch.ones(1), "sum", None) is not None else "ring"


def alpha_beta(world: int = 2, repeats: int = 15) -> tuple[float, float, float, str]:
    """(alpha, bandwidth, comm_cpu, algorithm): the fitted link, the CPU share of its time,
    and what the fit describes: "shm" where comms' all-reduce takes shared memory (one host,
    the default), else a ring."""
    ranks = spawn(_allreduce_times, world, args=(SIZES, repeats), timeout=300, backend="gloo")
    busy = statistics.mean(cpu for _, cpu, _ in ranks)
    path = ranks[0][2]
    fit = (fit_shm(SIZES, ranks[0][0], world) if path == "shm"
           else fit_alpha_beta(SIZES, ranks[0][0], world))
    return (*fit, busy, path)


def _step_times(world: World, engine: str, dim: int, depth: int, batch: int,
                repeats: int, bucket_mb: float) -> list[float]:
    from ..trace.steps import wrap

    torch.manual_seed(0)
    model = FullMLP(dim, depth)
    model = wrap(model, engine, bucket_mb) if distributed() else model
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(batch, dim), torch.randint(0, 2, (batch,))
    times = []
    for i in range(repeats + 3):
        if distributed():
            dist.barrier()
        t0 = time.perf_counter()
        _train_step(model, opt, x, y)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return times


def measured_step(world: int, engine: str, dim: int, depth: int, batch: int,
                  bucket_mb: float = 25.0, repeats: int = 15) -> float:
    """Median step time over ranks' medians, real ranks on this host."""
    per_rank = spawn(_step_times, world, args=(engine, dim, depth, batch, repeats, bucket_mb),
                     timeout=600, backend="gloo")  # CPU tensors: this models CPU training
    return statistics.median(statistics.median(t) for t in per_rank)


# Above this max/min ratio between rounds a figure is reported as unsteady: the host's load
# changed while it was measured, and a prediction from it is uncertain by as much.
WIDE_SPREAD = 1.5
SPREAD_NAMES = {"flops": ("compute", "FLOP/s"), "rank_flops": ("one rank alone", "FLOP/s"),
                "memory": ("memory", "B/s"), "alpha": ("latency (alpha)", "s"),
                "bandwidth": ("bandwidth (1/beta)", "B/s")}


def spread(values: list[float]) -> float:
    """max / min of positive measurements of one figure (1.0 = all the same)."""
    low = min(values)
    return max(values) / low if low > 0 else float("inf")


def report_spread(got: dict[str, list[float]], rounds: int) -> list[str]:
    """Print min / median / max over the rounds of each figure, and warn for every figure
    whose rounds differ by more than WIDE_SPREAD; returns the names of those figures."""
    print(f"measured over {rounds} rounds: min / median / max (spread = max / min)")
    wide = []
    for key, (name, unit) in SPREAD_NAMES.items():
        v = got[key]
        s = spread(v)
        print(f"  {name:19} {min(v):9.3g} / {statistics.median(v):9.3g} / {max(v):9.3g} {unit:6} "
              f"spread {s:.2f}x")
        if s > WIDE_SPREAD:
            wide.append(name)
    if wide:
        print(f"warning: {', '.join(wide)} varied by more than {WIDE_SPREAD:g}x between rounds: "
              "this host's load changed while it was measured, so predictions made from these "
              "figures are uncertain by as much; calibrate again when the machine is quiet",
              flush=True)
    return wide


def calibrate_and_verify(args: argparse.Namespace, rounds: int = 3) -> int:
    """Measure, save, and with --verify compare predictions with real step times.

    Calibration and verification alternate over `rounds` rounds and each figure is the median
    over rounds, so a change in the machine's load between them does not decide the result.
    """
    dim, depth, batch = args.dim, args.depth, int(args.batch)
    worlds = args.verify or []
    print(f"calibrating on FullMLP({dim}, depth {depth}), batch {batch}, {os.cpu_count()} cores, "
          f"{rounds} rounds ...")
    got: dict[str, list[float]] = {k: [] for k in ("flops", "memory", "alpha", "bandwidth",
                                                   "busy", "rank_flops")}
    steps: dict[int, list[float]] = {n: [] for n in worlds}
    pipeline_rounds: list[PipelineCosts] = []
    for _ in range(rounds):
        pipeline_rounds.append(measure_pipeline(os.cpu_count() or 1))
        flops, memory = host_rates(dim, depth, batch)
        got["flops"].append(flops)
        got["memory"].append(memory)
        got["rank_flops"].append(rank_rate(dim, depth, batch))
        alpha, bandwidth, busy, path = alpha_beta(2)
        got["alpha"].append(alpha)
        got["bandwidth"].append(bandwidth)
        got["busy"].append(busy)
        for n in worlds:
            steps[n].append(measured_step(n, "overlap", dim, depth, batch, args.bucket_mb))
    med = {k: statistics.median(v) for k, v in got.items()}
    report_spread(got, rounds)
    hw = Hardware(med["flops"], med["bandwidth"], med["alpha"],
                  "this host, measured by microddp predict --calibrate", cores=os.cpu_count() or 1,
                  memory=med["memory"], comm_cpu=med["busy"], rank_flops=med["rank_flops"],
                  algorithm=path)
    costs = median_costs(pipeline_rounds)
    save_calibration(hw, args.calibration, asdict(costs))
    print(f"compute {hw.flops:.3g} FLOP/s ({hw.rank_flops:.3g} for one rank alone), memory "
          f"{hw.memory:.3g} B/s, latency (alpha) {1e6 * hw.latency:.1f} us, bandwidth (1/beta) "
          f"{hw.bandwidth:.3g} B/s ({path} all-reduce), all-reduce keeps "
          f"{100 * hw.comm_cpu:.0f}% of a core busy; "
          f"saved to {args.calibration} "
          "(--hardware calibrated)")
    k = max(depth // 2, 1)
    widths = ", ".join(f"width {w}: F {1e6 * f[0]:.0f} us + blocks x ({1e6 * f[1]:.1f} us + "
                       f"FLOPs / {f[2]:.3g}), B {1e6 * b[0]:.0f} us + blocks x "
                       f"({1e6 * b[1]:.1f} us + 2 FLOPs / {b[2]:.3g})"
                       for (w, f), b in zip(costs.forward_widths.items(),
                                            costs.backward_widths.values(), strict=True))
    print(f"pipeline actions (the interpreter's GPipe and 1F1B, {costs.ranks} ranks, one stage each, 1 "
          f"thread each): {widths + '; other widths: ' if widths else ''}F = "
          f"{1e6 * costs.forward_fixed:.0f} us + blocks x ({1e6 * costs.forward_block:.1f} us + "
          f"weights x {1e9 * costs.forward_weight:.2f} ns + FLOPs / {costs.forward_rate:.3g}), "
          f"B = {1e6 * costs.backward_fixed:.0f} us + blocks x ({1e6 * costs.backward_block:.1f}"
          f" us + weights x {1e9 * costs.backward_weight:.2f} ns + 2 FLOPs / "
          f"{costs.backward_rate:.3g}) "
          f"(F {1e3 * costs.forward(k, 8, dim):.3f} ms, B {1e3 * costs.backward(k, 8, dim):.3f} ms for "
          f"{k} blocks of width {dim} x 8 rows); step +{1e6 * costs.step_fixed:.0f} us + "
          f"{1e6 * costs.step_block:.1f} us per block; actions' trimmed mean {costs.tail:.2f} x "
          f"their median; the last stage's head and loss "
          f"+{1e6 * costs.last_forward:.0f} us F, +{1e6 * costs.last_backward:.0f} us B; "
          f"messages {1e6 * costs.latency:.0f} us + bytes / {costs.bandwidth:.3g} B/s, a send "
          f"{1e6 * costs.send:.0f} us, a receive {1e6 * costs.receive:.0f} us, "
          f"+{1e6 * costs.wake:.0f} us wake-up where a receive waits (over every schedule and "
          "width; each schedule's own at each width: " + "; ".join(
              f"{name} width {w} {1e6 * s:.0f}, {1e6 * r:.0f}, +{1e6 * k:.0f} us"
              for name, widths in costs.schedule_messages.items()
              for w, (s, r, k) in widths.items()) + ")")
    if not worlds:
        return 0
    print(f"{'ranks':>5} {'predicted ms':>13} {'measured ms':>12} {'error':>7}  {'limit':<10} "
          f"(engine overlap, batch {batch} per rank, local ranks share the host's compute)")
    worst = 0.0
    for n in worlds:
        row = predict(fullmlp(dim, depth), hw, n, batch, bucket_mb=args.bucket_mb,
                      local_ranks=n, algorithm=path)
        pred, meas = row["step_s"], statistics.median(steps[n])
        limit = "host CPU" if row["cpu_bound_s"] > row["chain_s"] else "one rank"
        err = (pred - meas) / meas
        worst = max(worst, abs(err))
        print(f"{n:>5} {1e3 * pred:>13.2f} {1e3 * meas:>12.2f} {100 * err:>+6.1f}%  {limit:<10}")
    print(f"worst error {100 * worst:.1f}% ({'within' if worst <= 0.25 else 'outside'} 25%)")
    return 0
