"""Sharded model state measured: memory per rank and step time of plain data parallelism,
ZeRO-1, 2 and 3, torch's ZeroRedundancyOptimizer (ZeRO-1) and FSDP2's `fully_shard` (ZeRO-3),
and microddp's classes of the same shapes (zero-optimizer under torch's DDP as torch-zero1 is,
fully-shard per layer as fsdp2 is).

Every contender trains its own copy of the same FullMLP with Adam on the same batches and
ranks; their steps are interleaved (a fresh random order each round, a barrier before each) so
load on the machine hits all alike. Memory is measured from the live tensors of each rank when
the optimizer step starts (gradients ready, Adam's state from the step before), counting each
storage once: parameters, gradients, optimizer state. FSDP2's tensors are DTensors; what a
rank holds is their local shard. The peak is measured apart, each contender alone in fresh
ranks: how far a few steps raise the rank process's peak resident memory (ru_maxrss) above
where it stood before the model was built (activations, gathered layers and buffers in flight
included, which the live tensors at the step miss).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from .. import flags, outputs, zero
from ..errors import MicroDDPError
from ..model import FullMLP
from ..timing import compare, interleaved
from ..world.world import World

EPILOG = """\
examples:
  microddp bench zero --ranks 2 --dim 64 --depth 2 --repeats 3 --out runs/zero
  microddp bench zero                              # 2 and 4 ranks, every contender
  microddp bench zero --ranks 4 --contenders zero1 torch-zero1 --repeats 30
writes zero.json and zero.png into a new runs/bench-zero-DATE-TIME (or --out).
"""

CONTENDERS = ("dp", "zero1", "zero2", "zero3", "torch-zero1", "fsdp2", "zero-optimizer",
              "fully-shard")
# On request: both ZeroRedundancyOptimizers with parameters_as_bucket_view=True
BUCKET_VIEW = ("zero-optimizer-bv", "torch-zero1-bv")
# An A/A control, on request only: a second torch ZeRO-1, identical to the first, so the
# ratio of the two shows what this machine's noise alone makes of a ratio of medians.
CONTROL = "torch-zero1-again"
VERSUS = {"zero1": "torch-zero1", "zero3": "fsdp2",  # the same stage, ours and torch's
          "zero-optimizer": "torch-zero1", "fully-shard": "fsdp2",  # the same API too
          "zero-optimizer-bv": "torch-zero1-bv",
          CONTROL: "torch-zero1"}
KEYS = ("params", "grads", "optimizer_state")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `microddp bench zero`."""
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4],
                   help="world sizes (default 2 4)")
    p.add_argument("--contenders", nargs="+", default=list(CONTENDERS),
                   help=f"what to run (default {' '.join(CONTENDERS)}; add {CONTROL}, a "
                   "second torch-zero1, for an A/A control of the ratio, and "
                   f"{' '.join(BUCKET_VIEW)} for both ZeroRedundancyOptimizers with bucket views)")
    p.add_argument("--dim", type=int, default=512, help="FullMLP width (default 512)")
    p.add_argument("--depth", type=int, default=8, help="FullMLP depth (default 8)")
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step (default 32)")
    p.add_argument("--repeats", type=int, default=20, help="timed steps per contender "
                   "(default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--no-peak", action="store_true", help="skip the peak memory runs (each "
                   "contender alone in fresh ranks)")
    p.add_argument("--out", default=None, help="folder for zero.json and zero.png (default: a "
                   "new runs/bench-zero-DATE-TIME)")


def _model(dim: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return FullMLP(dim, depth)


def _contender(world: World, name: str, dim: int, depth: int, memory: dict):
    """A step of `name`; each step stores this rank's bytes at its optimizer step in
    memory[name]."""
    model = _model(dim, depth)
    lr = 1e-3
    if name in ("zero1", "zero2", "zero3"):
        z = zero.Zero(model, torch.optim.Adam, stage=int(name[-1]), lr=lr)

        def zero_finish() -> None:
            memory[name] = z.measure_now()  # what Zero.memory() reports, as the step starts
            z.step()
            z.zero_grad()

        return z, zero_finish
    if name in ("fsdp2", "fully-shard"):
        if name == "fsdp2":
            from torch.distributed.fsdp import fully_shard
        else:
            fully_shard = zero.fully_shard
        for layer in list(model.modules()):
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        net, opt, held = model, torch.optim.Adam(model.parameters(), lr=lr), model
    elif name in ("torch-zero1", CONTROL, *BUCKET_VIEW, "zero-optimizer"):
        if name.startswith("zero-optimizer"):
            ZeroRedundancyOptimizer = zero.ZeroRedundancyOptimizer
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer

        net = nn.parallel.DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=lr,
                                      parameters_as_bucket_view=name.endswith("-bv"))
        held = model
    else:  # dp: microddp's DDP
        from ..dp import wrap

        net = wrap(model, "microddp")
        opt, held = torch.optim.Adam(model.parameters(), lr=lr), model
    # the sharded optimizers' own state lives in their inner optimizer, .optim
    state = opt.optim if name in ("torch-zero1", CONTROL, *BUCKET_VIEW, "zero-optimizer") else opt

    def finish() -> None:
        memory[name] = zero.measure(held, state)
        opt.step()
        opt.zero_grad()

    return net, finish


def _job(world: World, names: list[str], dim: int, depth: int, batch: int, repeats: int,
         warmup: int) -> dict:
    torch.set_num_threads(1)  # one core's worth per rank for every contender alike
    g = torch.Generator().manual_seed(1 + world.rank)
    x, y = torch.randn(batch, dim, generator=g), torch.randint(0, 2, (batch,), generator=g)
    memory: dict = {}
    steps = {}
    for name in names:
        net, finish = _contender(world, name, dim, depth, memory)

        def step(net=net, finish=finish) -> None:
            nn.functional.cross_entropy(net(x), y).backward()
            finish()

        steps[name] = step
    times = interleaved(steps, repeats, warmup, sync=dist.barrier)
    table = torch.tensor([times[n] for n in names], dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
    return {"times": {n: table[k].tolist() for k, n in enumerate(names)}, "memory": memory}


def _peak(world: World, name: str, dim: int, depth: int, batch: int, steps: int) -> int:
    """Bytes by which `steps` steps of `name`, alone in this fresh rank, raise its peak
    resident memory above where it stood before the model was built."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1 + world.rank)
    x, y = torch.randn(batch, dim, generator=g), torch.randint(0, 2, (batch,), generator=g)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    net, finish = _contender(world, name, dim, depth, {})
    for _ in range(steps):
        nn.functional.cross_entropy(net(x), y).backward()
        finish()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024  # KiB on Linux


def summarize(n: int, ranks: list[dict], names: list[str],
              peaks: dict[str, list[int]] | None = None) -> dict:
    """Per contender: each rank's bytes, the largest rank's total, the median step."""
    times = ranks[0]["times"]
    rows = {}
    for name in names:
        per_rank = [{k: r["memory"][name][k] for k in KEYS} for r in ranks]
        for m in per_rank:
            m["total"] = sum(m[k] for k in KEYS)
        rows[name] = {"memory_per_rank": per_rank,
                      "max_rank_total": max(m["total"] for m in per_rank),
                      "step_ms": round(1e3 * statistics.median(times[name]), 3)}
        if peaks and name in peaks:
            rows[name]["peak_rss_growth_per_rank"] = peaks[name]
    versus = {}
    for ours, theirs in VERSUS.items():
        if ours in names and theirs in names:
            ratio, (lo, hi) = compare(times[ours], times[theirs])
            versus[f"{ours}/{theirs}"] = {"ratio": round(ratio, 4),
                                          "interval_90": [round(lo, 4), round(hi, 4)]}
    return {"ranks": n, "contenders": rows, "versus_torch": versus}


def _kib(b: float) -> str:
    return f"{b / 1024:10.1f}"


def table(results: list[dict], params: int) -> str:
    """The printed table: measured bytes per rank and step time of every contender."""
    w = max([12, *(len(name) + 1 for res in results for name in res["contenders"])])
    lines = [f"{'ranks':>5} {'contender':{w}}{'params':>10}{'grads':>10}{'optimizer':>10}"
             f"{'total':>10}{'vs dp':>7}{'step ms':>9}{'peak':>10}   (KiB on the rank holding "
             "most; peak: the largest rank's growth of peak RSS)"]
    for res in results:
        rows = res["contenders"]
        dp = rows.get("dp", {}).get("max_rank_total")
        for name, r in rows.items():
            m = max(r["memory_per_rank"], key=lambda m: m["total"])
            rel = f"{m['total'] / dp:>7.2f}" if dp else f"{'-':>7}"
            peak = r.get("peak_rss_growth_per_rank")
            lines.append(f"{res['ranks']:>5} {name:{w}}" + "".join(_kib(m[k]) for k in KEYS)
                         + f"{_kib(m['total'])}{rel}{r['step_ms']:>9.2f}"
                         + (_kib(max(peak)) if peak else f"{'-':>10}"))
        for pair, v in res["versus_torch"].items():
            lo, hi = v["interval_90"]
            lines.append(f"{'':>5} {pair}: step time {v['ratio']:.3f}x ({lo:.3f}-{hi:.3f}, 90% "
                         "interval), ratio of medians, interleaved")
    lines.append(f"{params} parameters, Adam, fp32; memory from the live tensors at the "
                 "optimizer step; step: the slowest rank's, median")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    """Memory per rank of every contender as stacked bars, one panel per world size."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    labels, bottoms = [], []
    bars = {k: [] for k in KEYS}
    steps = []
    for res in results:
        for name, r in res["contenders"].items():
            m = max(r["memory_per_rank"], key=lambda m: m["total"])
            labels.append(f"{res['ranks']} {name}")
            for k in KEYS:
                bars[k].append(m[k] / 2**20)
            steps.append(r["step_ms"])
    bottoms = [0.0] * len(labels)
    for k, color in zip(KEYS, ("tab:blue", "tab:orange", "tab:green"), strict=True):
        axes[0].bar(labels, bars[k], bottom=bottoms, color=color, label=k)
        bottoms = [b + v for b, v in zip(bottoms, bars[k], strict=True)]
    axes[0].set(title="model state on the rank holding most", ylabel="MiB")
    axes[0].legend()
    axes[1].bar(labels, steps, color="tab:gray")
    axes[1].set(title="step time (slowest rank, median)", ylabel="ms")
    for ax in axes:
        ax.tick_params(axis="x", rotation=60)
    fig.tight_layout()
    with outputs.atomic(path) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """Run `microddp bench zero` on each world size and write zero.json and zero.png."""
    from ..launch.spawn import spawn

    flags.at_least(2, ranks=args.ranks)
    flags.at_least(1, dim=args.dim, depth=args.depth, batch=args.batch, repeats=args.repeats)
    flags.at_least(0, warmup=args.warmup)
    flags.distinct("ranks", args.ranks)
    flags.distinct("contenders", args.contenders)
    unknown = [c for c in args.contenders if c not in (*CONTENDERS, *BUCKET_VIEW, CONTROL)]
    if unknown:
        raise MicroDDPError(f"unknown contender(s) {', '.join(unknown)}; choose from "
                            f"{', '.join(CONTENDERS)} (and {', '.join(BUCKET_VIEW)}; "
                            f"{CONTROL}, an A/A control)")
    names = [c for c in (*CONTENDERS, *BUCKET_VIEW, CONTROL) if c in args.contenders]
    params = sum(p.numel() for p in _model(args.dim, args.depth).parameters())
    with outputs.run_folder(args.out, "bench-zero") as out:
        load = os.getloadavg()
        results = []
        for n in args.ranks:
            ranks = spawn(_job, n, args=(names, args.dim, args.depth, args.batch, args.repeats,
                                         args.warmup), backend="gloo", timeout=1800)
            peaks = {} if args.no_peak else {
                name: spawn(_peak, n, args=(name, args.dim, args.depth, args.batch,
                                            args.warmup + 2), backend="gloo", timeout=600)
                for name in names}
            results.append(summarize(n, ranks, names, peaks))
        la = ", ".join(f"{x:.2f}" for x in load)
        print(f"FullMLP({args.dim}, depth {args.depth}), batch {args.batch} per rank, gloo, "
              f"{args.repeats} interleaved steps per contender; load average {la}")
        print(table(results, params))
        doc = {"config": {"dim": args.dim, "depth": args.depth, "batch": args.batch,
                          "repeats": args.repeats, "warmup": args.warmup, "params": params,
                          "optimizer": "Adam", "backend": "gloo",
                          "load_average": [round(x, 2) for x in load]},
               "results": results}
        outputs.write_text(out / "zero.json", json.dumps(doc, indent=1) + "\n")
        plot(results, out / "zero.png")
        print(outputs.wrote([out / "zero.json", out / "zero.png"]))
    return 0
