"""Strong and weak scaling, microddp and PyTorch DDP side by side, over 1..N ranks.

Strong scaling keeps the global batch and splits it over more ranks; weak scaling keeps the
batch per rank. At each world size the engines take turns step by step (interleaved, so load
on the machine hits both alike); the median step gives throughput, speedup over one process,
efficiency = speedup / N, and the traced spans split each step into compute, exposed
communication and the rest.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from .. import flags, outputs, spans
from ..errors import MicroDDPError
from ..launch.spawn import spawn
from ..model import FullMLP
from ..timing import interleaved
from ..trace import report as trace_report
from ..world.world import World, distributed

EPILOG = """\
examples:
  microddp bench scaling                            # 1, 2, 4 ranks; microddp's DDP vs torch's
  microddp bench scaling --ranks 1 2 --dim 1024 --depth 4 --repeats 30
  microddp bench scaling --engines microddp torch --out runs/scaling
writes scaling.csv and scaling.png into a new runs/bench-scaling-DATE-TIME (or --out); a table
and a verdict on stdout.
"""


def _contender(world: World, engine: str, dim: int, depth: int, batch: int):
    """A step function for one engine, recording its spans into its own recorder."""
    from ..trace.steps import traced_step, wrap

    torch.manual_seed(0)
    model = FullMLP(dim, depth).to(world.device)
    if distributed():
        model = wrap(model, engine)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(world.rank)
    x = torch.randn(batch, dim, generator=gen).to(world.device)
    y = torch.randint(0, 2, (batch,), generator=gen).to(world.device)
    rec = spans.Recorder()

    def step() -> None:
        with spans.use(rec):
            traced_step(model, opt, x, y)

    return step, rec


def _job(world: World, engines: list[str], dim: int, depth: int, batch: int, repeats: int,
         warmup: int) -> dict:
    names = engines if distributed() else ["1 process"]
    made = {e: _contender(world, e, dim, depth, batch) for e in names}
    sync = dist.barrier if distributed() else None
    times = interleaved({e: m[0] for e, m in made.items()}, repeats, warmup, sync)
    walled = {e: [s for s in trace_report.to_wall(m[1]) if s.step >= warmup]
              for e, m in made.items()}
    return {e: (times[e], walled[e]) for e in names}


def measure(n: int, per_rank: int, engines: list[str], dim: int, depth: int, repeats: int,
            warmup: int) -> dict:
    """One spawn of n ranks: per engine, rank 0's step times and every rank's spans."""
    out = spawn(_job, n, args=(engines, dim, depth, per_rank, repeats, warmup), timeout=900)
    return {e: (out[0][e][0], {r: res[e][1] for r, res in enumerate(out)}) for e in out[0]}


def summarize(mode: str, n: int, per_rank: int, runs: list[dict]) -> list[dict]:
    """Rows for one (mode, world size) from several rounds: median step, mean split."""
    rows = []
    for engine in runs[0]:
        step = statistics.median(t for run in runs for t in run[engine][0])
        by_rank: dict[int, list] = {}
        for k, run in enumerate(runs):  # keep the rounds' steps apart
            for r, mine in run[engine][1].items():
                by_rank.setdefault(r, []).extend(
                    spans.Span(s.name, s.start, s.end, s.track, (k, s.step), s.args)
                    for s in mine)
        split = trace_report.summarize(trace_report.per_step(by_rank))
        # The trace gives shares of a (mean) step; scale them to the median step timed.
        share = step / split["step_s"] if split["step_s"] > 0 else 0.0
        compute, exposed = share * split["compute_s"], share * split["exposed_comm_s"]
        rows.append({"mode": mode, "ranks": n, "engine": engine, "batch_per_rank": per_rank,
                     "step_ms": 1e3 * step, "samples_per_s": n * per_rank / step,
                     "compute_ms": 1e3 * compute, "exposed_comm_ms": 1e3 * exposed,
                     "other_ms": 1e3 * max(0.0, step - compute - exposed)})
    return rows


def round_repeats(repeats: int, rounds: int) -> list[int]:
    """Timed steps in each round: `repeats` in all, the remainder spread over the first rounds."""
    if repeats < rounds:
        raise MicroDDPError(f"--repeats {repeats} cannot give each of --rounds {rounds} a timed "
                            "step: use at least as many repeats as rounds")
    base, extra = divmod(repeats, rounds)
    return [base + (1 if k < extra else 0) for k in range(rounds)]


def strong_batch_notes(modes: list[str], ranks: list[int], batch: int) -> list[str]:
    """Where strong scaling's global batch is not --batch: it must be split into whole
    per-rank batches, so `batch // n` each and the rest left out of every step."""
    if "strong" not in modes:
        return []
    shrunk = [f"{n} ranks {batch // n * n} ({batch // n} each)" for n in ranks if batch % n]
    if not shrunk:
        return []
    return [f"note: strong scaling keeps the global batch of {batch} only where it splits "
            f"evenly; elsewhere a step trains fewer samples: {', '.join(shrunk)}. "
            "Speedups compare samples per second, so they stay fair"]


def sweep(modes: list[str], ranks: list[int], engines: list[str], dim: int, depth: int,
          batch: int, repeats: int, warmup: int, rounds: int) -> list[dict]:
    """Every (mode, world size) once per round, rounds after one another, so that a change in
    the machine's load spreads over all configurations instead of biasing one."""
    configs = {(m, n): batch // n if m == "strong" else batch for m in modes for n in ranks}
    runs: dict[tuple[int, int], list[dict]] = {}
    for steps in round_repeats(repeats, rounds):
        for n, per_rank in dict.fromkeys((n, b) for (_, n), b in configs.items()):
            runs.setdefault((n, per_rank), []).append(
                measure(n, per_rank, engines, dim, depth, steps, warmup))
    return [row for (m, n), b in configs.items() for row in summarize(m, n, b, runs[(n, b)])]


def add_speedup(rows: list[dict]) -> None:
    """speedup = throughput / one process's (same mode); efficiency = speedup / ranks."""
    for mode in {r["mode"] for r in rows}:
        base = [r for r in rows if r["mode"] == mode and r["ranks"] == 1]
        if not base:
            raise MicroDDPError("scaling needs a 1-rank baseline: include 1 in --ranks")
        for r in rows:
            if r["mode"] == mode:
                r["speedup"] = r["samples_per_s"] / base[0]["samples_per_s"]
                r["efficiency"] = r["speedup"] / r["ranks"]


def size_text(nbytes: float) -> str:
    """Bytes for people: '2.2 KB', '16.1 MB' (a small model's gradients are not '0.0 MB')."""
    units, k = ("B", "KB", "MB", "GB"), 0
    while nbytes >= 1024 and k < len(units) - 1:
        nbytes, k = nbytes / 1024, k + 1
    return f"{nbytes:.0f} B" if k == 0 else f"{nbytes:.1f} {units[k]}"


def gradient_bytes(dim: int, depth: int) -> int:
    """What one step all-reduces: FullMLP's float32 gradients."""
    return sum(p.numel() for p in FullMLP(dim, depth).parameters()) * 4


def verdicts(rows: list[dict], grad_mb: float, cores: int) -> list[str]:
    """Plain words about where data parallelism pays on this host, and why not where it does not."""
    out = []
    base = {r["mode"]: r for r in rows if r["ranks"] == 1}
    for r in rows:
        if r["ranks"] == 1 or r["efficiency"] >= 0.5:
            continue
        b = base[r["mode"]]
        expected = b["compute_ms"] * r["batch_per_rank"] / b["batch_per_rank"]
        if r["exposed_comm_ms"] > r["compute_ms"]:
            why = (f"exposed communication ({r['exposed_comm_ms']:.1f} ms for "
                   f"{size_text(grad_mb * 2**20)} of gradients) outweighs compute "
                   f"({r['compute_ms']:.1f} ms): the model is too small for the link")
        elif r["compute_ms"] > 1.3 * expected:
            why = (f"compute per rank took {r['compute_ms']:.1f} ms where one process needed "
                   f"{expected:.1f} ms for the same samples: the ranks compete for this host's "
                   "cores and memory")
        else:
            why = (f"exposed communication ({r['exposed_comm_ms']:.1f} ms) and other work "
                   f"({r['other_ms']:.1f} ms) eat the gain")
        worth = "not worth it" if r["speedup"] < 1 else "barely worth it"
        out.append(f"{r['mode']}, {r['ranks']} ranks, {r['engine']}: DDP is {worth} (speedup "
                   f"{r['speedup']:.2f}, efficiency {100 * r['efficiency']:.0f}%): {why}")
    if any(r["ranks"] > cores for r in rows):
        out.append(f"note: more ranks than this host's {cores} cores time-share them, so "
                   "compute cannot speed up there; use more hosts or GPUs to see real scaling")
    return out or ["data parallelism paid off at every world size measured (efficiency >= 50%)"]


def weak_efficiency(rows: list[dict]) -> list[str]:
    """Weak-scaling efficiency (one process's step time / the engine's step time at the same
    batch per rank) of every engine side by side, one line per world size."""
    out = []
    for n in sorted({r["ranks"] for r in rows if r["mode"] == "weak" and r["ranks"] > 1}):
        sel = [r for r in rows if r["mode"] == "weak" and r["ranks"] == n]
        out.append(f"weak-scaling efficiency, {n} ranks: " + ", ".join(
            f"{r['engine']} {r['efficiency']:.2f}" for r in sel))
    return out


def table(rows: list[dict]) -> str:
    """The scaling results as a fixed-width text table, one line per mode, world size and engine."""
    head = (f"{'mode':6} {'ranks':>5} {'engine':10} {'batch':>5} {'step ms':>8} {'samples/s':>10} "
            f"{'speedup':>7} {'eff':>5} {'compute':>8} {'exp.comm':>8} {'other':>7}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['mode']:6} {r['ranks']:>5} {r['engine']:10} {r['batch_per_rank']:>5} "
                     f"{r['step_ms']:>8.2f} {r['samples_per_s']:>10.0f} {r['speedup']:>7.2f} "
                     f"{100 * r['efficiency']:>4.0f}% {r['compute_ms']:>8.2f} "
                     f"{r['exposed_comm_ms']:>8.2f} {r['other_ms']:>7.2f}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Draw the speedup of strong and weak scaling against the ideal, and where a weak-scaling
    step's time goes, into the PNG at `path`."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, mode in zip(axes[:2], ("strong", "weak"), strict=True):
        sel = [r for r in rows if r["mode"] == mode]
        ranks = sorted({r["ranks"] for r in sel})
        ax.plot(ranks, ranks, "k--", label="ideal")
        for engine in dict.fromkeys(r["engine"] for r in sel if r["ranks"] > 1):
            pts = [(1, 1.0)] + [(r["ranks"], r["speedup"]) for r in sel if r["engine"] == engine]
            ax.plot(*zip(*pts, strict=True), "o-", label=engine)
        ax.set(title=f"{mode} scaling", xlabel="ranks", ylabel="speedup over 1 process")
        ax.legend()
    bars = [r for r in rows if r["mode"] == "weak"]
    labels = [r["engine"] if r["ranks"] == 1 else f"{r['ranks']} {r['engine']}" for r in bars]
    bottom = [0.0] * len(bars)
    for key, color in (("compute_ms", "tab:blue"), ("exposed_comm_ms", "tab:red"),
                       ("other_ms", "tab:gray")):
        vals = [r[key] for r in bars]
        axes[2].bar(labels, vals, bottom=bottom, color=color, label=key.removesuffix("_ms"))
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    axes[2].set(title="weak scaling: where a step goes", ylabel="ms per step")
    axes[2].tick_params(axis="x", rotation=45)
    axes[2].legend()
    fig.tight_layout()
    with outputs.atomic(path) as tmp:  # a reader never sees half a PNG
        fig.savefig(tmp, dpi=110)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `microddp bench scaling`: world sizes, engines, model, batch, modes,
    repetitions."""
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4],
                   help="world sizes (default 1 2 4)")
    p.add_argument("--engines", nargs="+", default=["microddp", "torch"],
                   help="DDP engines to compare: naive hooks buckets overlap microddp torch "
                        "(default microddp torch)")
    p.add_argument("--dim", type=int, default=512, help="FullMLP width (default 512)")
    p.add_argument("--depth", type=int, default=8, help="FullMLP depth (default 8)")
    p.add_argument("--batch", type=int, default=64, help="weak: per rank; strong: global "
                   "(default 64)")
    p.add_argument("--modes", nargs="+", choices=("strong", "weak"), default=["strong", "weak"],
                   help="strong: a fixed global batch split over the ranks; weak: a fixed batch "
                   "per rank (default strong weak: both)")
    p.add_argument("--repeats", type=int, default=20,
                   help="timed steps per engine and world size, all rounds together (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--rounds", type=int, default=3, help="passes over all configurations "
                   "(default 3)")
    p.add_argument("--threads", type=int, default=1, help="threads per rank, the same at every "
                   "world size (one 'device' per rank, as with GPUs; default 1)")
    p.add_argument("--out", default=None, help="folder for scaling.csv and scaling.png "
                   "(default: a new runs/bench-scaling-DATE-TIME)")


def run(args: argparse.Namespace) -> int:
    """Check the flags, measure every world size and engine, and write the table, CSV and PNG;
    the exit code."""
    flags.at_least(1, ranks=args.ranks, repeats=args.repeats, rounds=args.rounds,
                    threads=args.threads, dim=args.dim, batch=args.batch)
    flags.at_least(0, depth=args.depth, warmup=args.warmup)
    flags.engines(args.engines)
    if 1 not in args.ranks:
        raise MicroDDPError("scaling needs a 1-rank baseline: include 1 in --ranks")
    if "strong" in args.modes and args.batch < max(args.ranks):
        raise MicroDDPError(f"strong scaling splits --batch {args.batch} over up to "
                            f"{max(args.ranks)} ranks: make it at least that large")
    round_repeats(args.repeats, args.rounds)  # refuses too few repeats now, not mid-sweep
    with outputs.run_folder(args.out, "bench-scaling") as out:
        return _run(args, out)


def _run(args: argparse.Namespace, out: Path) -> int:
    ranks = sorted(set(args.ranks))
    grad_bytes = gradient_bytes(args.dim, args.depth)
    print(f"FullMLP({args.dim}, depth {args.depth}): {size_text(grad_bytes)} of gradients; "
          f"{args.repeats} interleaved steps per engine in {args.rounds} rounds; "
          f"{args.threads} thread(s) per rank on {os.cpu_count()} cores")
    for line in strong_batch_notes(args.modes, ranks, args.batch):
        print(line)
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # what spawn gives each rank
    try:
        rows = sweep(args.modes, ranks, args.engines, args.dim, args.depth,
                     args.batch, args.repeats, args.warmup, args.rounds)
    finally:
        if before is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = before
    add_speedup(rows)
    print(table(rows))
    for line in weak_efficiency(rows):
        print(line)
    for line in verdicts(rows, grad_bytes / 2**20, os.cpu_count() or 1):
        print(line)
    with outputs.atomic(out / "scaling.csv") as tmp, tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    plot(rows, out / "scaling.png")
    print(outputs.wrote([out / "scaling.csv", out / "scaling.png"]))
    return 0
