"""Trace a few DDP steps on N ranks (or read a trace.json): where does the time go?

Writes trace.json (open it in https://ui.perfetto.dev or chrome://tracing: one track per rank
for compute, one for communication), timeline.png, per-step rows in metrics.jsonl and hta/ (one
profiler-format trace per rank, for HolisticTraceAnalysis) into a new folder
runs/trace-DATE-TIME (or --out), and prints per-step compute, communication, exposed
communication and overlap.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from .. import flags, outputs
from ..dp.engines import ENGINES
from ..errors import MicroDDPError
from ..timing import median, ratio_of_medians
from ..trace import report as trace_report
from ..trace import steps

EPILOG = """\
examples:
  microddp trace                          # 2 ranks, overlap engine, 10 steps -> runs/trace-*/
  microddp trace -n 4 --engine torch --dim 1024 --depth 8 --out runs/torch-trace
  microddp trace runs/torch-trace/trace.json   # summarise that trace again (and redraw the PNG)
  microddp trace --overhead --steps 200   # what recording spans and logging collectives cost
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `microddp trace`: a trace to summarise, or the run to record."""
    p.add_argument("path", nargs="?", help="an existing trace.json to summarise (no run)")
    p.add_argument("-n", "--nproc", type=int, default=2, help="ranks to run (default 2)")
    p.add_argument("--engine", choices=ENGINES, default="overlap",
                   help="DDP engine to trace (default overlap; torch = PyTorch's DDP)")
    p.add_argument("--dim", type=int, default=256, help="FullMLP width (default 256)")
    p.add_argument("--depth", type=int, default=8, help="FullMLP layers (default 8)")
    p.add_argument("--batch", type=int, default=64,
                   help="samples per rank per step (default 64)")
    p.add_argument("--steps", type=int, default=10, help="steps to trace (default 10)")
    p.add_argument("--bucket-cap-mb", type=float, default=1.0, help="bucket size (default 1)")
    p.add_argument("--out", default=None, help="folder for trace.json, timeline.png and "
                   "metrics.jsonl (default: a new runs/trace-DATE-TIME)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds before giving up (default 300)")
    p.add_argument("--overhead", action="store_true", help="measure what tracing and the "
                   "collective monitor cost per step instead (--steps interleaved steps each)")


def _print_steps(rows: list[dict]) -> None:
    print(f"{'step':>4} {'step ms':>9} {'compute':>9} {'comm':>9} {'exposed':>9} "
          f"{'overlap':>8}")
    for r in rows:
        ov = "n/a" if r["overlap_pct"] is None else f"{r['overlap_pct']:.0f}%"
        print(f"{r['step']:>4} {r['step_ms']:>9.2f} {r['compute_ms']:>9.2f} {r['comm_ms']:>9.2f} "
              f"{r['exposed_comm_ms']:>9.2f} {ov:>8}")


def _summarise(path: str, redraw: bool = True) -> int:
    by_rank = trace_report.load(path)
    rows = trace_report.per_step(by_rank)
    if not rows:
        raise MicroDDPError(f"{path} holds no spans; was the run traced?")
    _print_steps([trace_report.in_ms(r) for r in rows])
    summary = trace_report.in_ms(trace_report.summarize(rows))
    print(trace_report.format_summary(summary))
    if not redraw:  # a run that has just drawn it
        return 0
    png = Path(path).with_name("timeline.png")
    trace_report.plot_timeline(by_rank, png)
    print(f"{len(by_rank)} rank(s); " + outputs.wrote([png], "timeline redrawn:"))
    return 0


def _overhead(args: argparse.Namespace, kwargs: dict) -> int:
    """How much recording spans and logging collectives cost per step (ratio of medians)."""
    print(f"measuring overhead: {args.steps} interleaved steps each, {args.nproc} rank(s), "
          f"engine {args.engine}, FullMLP({args.dim}, depth {args.depth})")
    times = steps.overhead_times(args.nproc, kwargs, args.steps, args.timeout)
    base = median(times["plain"])
    for name in ("traced", "monitored", "control"):
        r = ratio_of_medians(times[name], times["plain"])
        print(f"  {name:9} {1e3 * median(times[name]):8.3f} ms vs plain {1e3 * base:8.3f} ms: "
              f"ratio of medians {r:.4f} ({100 * (r - 1):+.2f}%)")
    print("traced = spans recorded, monitored = collectives logged by microddp.monitor, control "
          "= plain timed again (A/A): a gap no larger than control's is noise")
    return 0


def run(args: argparse.Namespace) -> int:
    """Record a few traced DDP steps (or summarise a saved trace) and print where the time went."""
    if args.path:
        return _summarise(args.path)
    flags.at_least(1, nproc=args.nproc, dim=args.dim, depth=args.depth, batch=args.batch,
                   steps=args.steps)
    if args.bucket_cap_mb <= 0 or math.isnan(args.bucket_cap_mb):
        raise MicroDDPError("--bucket-cap-mb must be positive")
    if args.engine == "torch" and args.nproc < 2:
        raise MicroDDPError("--engine torch needs at least 2 ranks (-n 2)")
    kwargs = {"engine": args.engine, "dim": args.dim, "depth": args.depth,
              "batch": args.batch, "steps": args.steps, "bucket_cap_mb": args.bucket_cap_mb}
    if args.overhead:
        return _overhead(args, kwargs)
    with outputs.run_folder(args.out, "trace") as out:
        print(f"tracing {args.steps} steps of FullMLP({args.dim}, depth {args.depth}) on "
              f"{args.nproc} rank(s), engine {args.engine}, batch {args.batch} per rank")
        summary = steps.record(str(out), args.nproc, kwargs, args.timeout)
    _summarise(summary["trace_json"], redraw=False)
    print(f"per-rank traces for HolisticTraceAnalysis in {out / 'hta'} "
          f"(TraceAnalysis(trace_dir=\"{out / 'hta'}\", include_last_profiler_step=True))")
    print(outputs.wrote([summary["trace_json"], summary["timeline_png"], out / "metrics.jsonl"])
          + " (open trace.json in https://ui.perfetto.dev)")
    return 0
