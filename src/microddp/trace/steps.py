"""Trace a few DDP steps on N ranks (or read a trace.json): where does the time go?

Writes trace.json (open it in https://ui.perfetto.dev or chrome://tracing: one track per rank
for compute, one for communication), timeline.png and per-step rows in metrics.jsonl into a new
folder runs/trace-DATE-TIME (or --out), and prints per-step compute, communication, exposed
communication and overlap.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from .. import flags, outputs
from .. import spans as trace
from ..comms.world import World, distributed
from ..dp.engines import ENGINES
from ..errors import MicroDDPError
from ..launch.spawn import spawn
from . import report as trace_report

EPILOG = """\
examples:
  microddp trace                          # 2 ranks, overlap engine, 10 steps -> runs/trace-*/
  microddp trace -n 4 --engine torch --dim 1024 --depth 8 --out runs/torch-trace
  microddp trace runs/torch-trace/trace.json   # summarise that trace again (and redraw the PNG)
  microddp trace --overhead --steps 200   # what recording spans and logging collectives cost
"""




def _traced_torch_ddp(module: nn.Module, bucket_cap_mb: float) -> nn.Module:
    """PyTorch's own DDP, with a comm hook that averages exactly as its default and times it."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb)

    def hook(state, bucket):  # unannotated: torch checks annotations, and ours are strings
        launched = time.perf_counter()
        buf = bucket.buffer().div_(dist.get_world_size())
        fut = dist.all_reduce(buf, async_op=True).get_future()

        def done(f: torch.futures.Future) -> torch.Tensor:
            trace.add_span(f"allreduce bucket {bucket.index()}", launched, time.perf_counter(),
                           track="comm", bucket=bucket.index(), bytes=buf.numel() * buf.element_size())
            return f.value()[0]

        return fut.then(done)

    ddp.register_comm_hook(None, hook)
    # torch waits for its buckets inside backward, in C++; the last gradient's arrival marks
    # where that wait begins, so the trace can show it as such rather than as compute.
    last = ddp._microddp_last_grad = [0.0]
    for p in module.parameters():
        p.register_post_accumulate_grad_hook(lambda _p: last.__setitem__(0, time.perf_counter()))
    return ddp


def note_wait(model: nn.Module) -> None:
    """After backward of a traced torch DDP: record its hidden end-of-backward wait."""
    last = getattr(model, "_microddp_last_grad", None)
    if last is not None and last[0] > 0:
        trace.add_span("wait comm", last[0], time.perf_counter(), track="comm_wait")


def traced_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                y: torch.Tensor) -> None:
    """One training step with forward, backward (and its wait for communication) and
    optimizer spans; the spans are dropped when no recorder is active."""
    with trace.span("forward"):
        loss = nn.functional.cross_entropy(model(x), y)
    with trace.span("backward"):
        loss.backward()
        note_wait(model)
    with trace.span("optimizer", track="optim"):
        opt.step()
        opt.zero_grad(set_to_none=True)
    trace.next_step()


def wrap(module: nn.Module, engine: str, bucket_cap_mb: float = 25.0) -> nn.Module:
    """A data-parallel wrapper whose communication shows up in the trace."""
    if engine == "torch":
        return _traced_torch_ddp(module, bucket_cap_mb)
    from ..dp import wrap as dp_wrap

    return dp_wrap(module, engine, bucket_cap_mb=bucket_cap_mb)


def run_steps(world: World, engine: str = "overlap", dim: int = 256, depth: int = 8,
              batch: int = 64, steps: int = 10, bucket_cap_mb: float = 1.0) -> nn.Module:
    """Train FullMLP for `steps` SGD steps, marking spans (recorded only if tracing is on).

    `batch` is per rank; the data is synthetic, a different shard on each rank.
    """
    from ..model import FullMLP

    torch.manual_seed(0)
    model = wrap(FullMLP(dim, depth).to(world.device), engine, bucket_cap_mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1000 + world.rank)
    batches = [(torch.randn(batch, dim, generator=gen),
                torch.randint(0, 2, (batch,), generator=gen)) for _ in range(min(steps, 4))]
    for i in range(steps):
        with trace.span("data", track="data"):
            x, y = (t.to(world.device) for t in batches[i % len(batches)])
        traced_step(model, opt, x, y)
    return model


def traced_steps(world: World, run_dir: str, **kwargs) -> dict:
    """`run_steps` with the recorder on; returns trace_report.finish's summary."""
    trace.start()
    run_steps(world, **kwargs)
    return trace_report.finish(run_dir, world)


def _run_job(world: World, run_dir: str, kwargs: dict) -> dict:
    return traced_steps(world, run_dir, **kwargs)


def _overhead_job(world: World, kwargs: dict, repeats: int) -> dict[str, list[float]]:
    """Step times with nothing on, with the recorder on, and with the collective monitor on."""
    from .. import monitor
    from ..model import FullMLP
    from ..monitor import patch
    from ..timing import interleaved

    torch.manual_seed(0)
    dim, batch = kwargs["dim"], kwargs["batch"]
    model = wrap(FullMLP(dim, kwargs["depth"]), kwargs["engine"], kwargs["bucket_cap_mb"])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(batch, dim), torch.randint(0, 2, (batch,))
    mon = monitor.enable(timeout=120) if distributed() else None
    rec = trace.Recorder()

    def step(recording: bool, monitoring: bool) -> None:
        patch._active = mon if monitoring else None  # wrappers stay installed: one lookup
        with trace.use(rec if recording else None):
            traced_step(model, opt, x, y)

    sync = dist.barrier if distributed() else None
    # "control" is plain again, last in each round: its ratio to plain is the noise floor.
    out = interleaved({"plain": lambda: step(False, False), "traced": lambda: step(True, False),
                       "monitored": lambda: step(False, True),
                       "control": lambda: step(False, False)}, repeats, warmup=3, sync=sync)
    monitor.disable()
    return out


def overhead(args: argparse.Namespace, kwargs: dict) -> int:
    """How much recording spans and logging collectives cost per step (ratio of medians)."""
    from ..timing import median, ratio_of_medians

    print(f"measuring overhead: {args.steps} interleaved steps each, {args.nproc} rank(s), "
          f"engine {args.engine}, FullMLP({args.dim}, depth {args.depth})")
    # CPU model and batches, on gloo even on a GPU host: the cost measured is the Python
    # bookkeeping of spans and monitor records, which the CPU pays either way.
    times = spawn(_overhead_job, args.nproc, args=(kwargs, args.steps), timeout=args.timeout,
                  backend="gloo")[0]
    base = median(times["plain"])
    for name in ("traced", "monitored", "control"):
        r = ratio_of_medians(times[name], times["plain"])
        print(f"  {name:9} {1e3 * median(times[name]):8.3f} ms vs plain {1e3 * base:8.3f} ms: "
              f"ratio of medians {r:.4f} ({100 * (r - 1):+.2f}%)")
    print("traced = spans recorded, monitored = collectives logged by microddp.monitor, control "
          "= plain timed again (A/A): a gap no larger than control's is noise")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
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


def run(args: argparse.Namespace) -> int:
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
        return overhead(args, kwargs)
    with outputs.run_folder(args.out, "trace") as out:
        print(f"tracing {args.steps} steps of FullMLP({args.dim}, depth {args.depth}) on "
              f"{args.nproc} rank(s), engine {args.engine}, batch {args.batch} per rank")
        summary = spawn(_run_job, args.nproc, args=(str(out), kwargs), timeout=args.timeout)[0]
    _summarise(summary["trace_json"], redraw=False)
    print(outputs.wrote([summary["trace_json"], summary["timeline_png"], out / "metrics.jsonl"])
          + " (open trace.json in https://ui.perfetto.dev)")
    return 0
