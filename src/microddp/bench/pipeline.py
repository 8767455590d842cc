"""Pipeline schedules measured: bubble, activation memory and step time, and torch's schedules.

Every schedule trains its own copy of the same FullMLP, cut into the same stages, on the same
ranks; their steps are interleaved (a fresh random order each round, a barrier before each
step) with those of torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble (and ScheduleZBVZeroBubble, with
zero-bubble) and of microddp's classes of the same names (microddp.pipeline.PipelineStage
and its schedules, called by the same code as torch's: the import swapped), so load on the
machine hits all alike. For microddp's schedules each rank records when each of its
forwards and backwards ran (the bubble is the idle share of the ranks' time between the
step's first compute and its last) and how many bytes each rank held at most: the
activations autograd saved (saved-tensor hooks) and the interpreter's message buffers (posted
receives, gradients not yet used, sends not yet waited for), measured, not computed.

`--compute sleep` makes every block of the model (Linear+ReLU) cost a fixed sleep forward and
twice that backward, on top of its real (tiny) compute: ranks that sleep do not fight for the
cores, so the timeline shows the schedule's shape rather than the machine's load.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

from .. import flags, outputs, pipeline
from ..errors import MicroDDPError
from ..model import FullMLP
from ..pipeline.activations import ActivationMeter
from ..pipeline.schedules import place
from ..pipeline.sleep import Sleeping
from ..timing import interleaved
from ..world.world import World
from . import pipeline_report as report

EPILOG = """\
examples:
  microddp bench pipeline --stages 2 --microbatches 4 --compute sleep --repeats 2 --out runs/pp
  microddp bench pipeline --stages 4 --microbatches 8 --compute sleep
  microddp bench pipeline --stages 4 --microbatches 8 --schedules gpipe 1f1b --repeats 20
writes pipeline.json, timeline-SCHEDULE.png per schedule and trace.json (open it in
https://ui.perfetto.dev) into a new runs/bench-pipeline-DATE-TIME (or --out).
"""

# the schedules torch.distributed.pipelining has as well, by their class names there (and in
# microddp.pipeline, whose classes of the same names run as "shaped-NAME")
TORCH = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
         "interleaved": "ScheduleInterleaved1F1B",
         "zero-bubble": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble"}
# zbv (2 stages per rank in a V) has no run_schedule counterpart here: it runs, with
# zero-bubble, as torch's class and microddp's only
loss_fn = nn.functional.cross_entropy


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `microddp bench pipeline`."""
    p.add_argument("--stages", type=int, default=4, help="pipeline ranks p (default 4)")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches m per step "
                   "(default 8)")
    p.add_argument("--schedules", nargs="+", default=list(pipeline.BUILDERS),
                   help=f"schedules to run (default {' '.join(pipeline.BUILDERS)})")
    p.add_argument("--compute", choices=("real", "sleep"), default="real",
                   help="real: the model's own compute; sleep: each block also sleeps "
                   "--sleep-ms forward, twice that backward (default real)")
    p.add_argument("--sleep-ms", type=float, default=2.0, help="with --compute sleep: ms a "
                   "block sleeps forward (default 2.0)")
    p.add_argument("--virtual", type=int, default=2, help="stages per rank of the interleaved "
                   "schedule (default 2)")
    p.add_argument("--dim", type=int, default=128, help="FullMLP width (default 128)")
    p.add_argument("--depth", type=int, default=16, help="FullMLP blocks; at least stages x "
                   "virtual for interleaved (default 16)")
    p.add_argument("--batch", type=int, default=64, help="samples per step, cut into the "
                   "micro-batches (default 64)")
    p.add_argument("--repeats", type=int, default=10, help="timed steps per contender "
                   "(default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--no-torch", action="store_true", help="leave out torch's schedules and "
                   "microddp's torch-shaped classes timed against them")
    p.add_argument("--no-pin", action="store_true", help="leave the ranks unpinned (by "
                   "default rank r runs on core r mod cores, its threads too: see "
                   "microddp.pipeline.placement)")
    p.add_argument("--out", default=None, help="folder for pipeline.json, the PNGs and "
                   "trace.json (default: a new runs/bench-pipeline-DATE-TIME)")


def wrap(stage: nn.Module, compute: str, sleep_ms: float) -> nn.Module:
    """Put one rank's stage under the chosen compute mode (real layers or fixed sleeps)."""
    return Sleeping(stage, sleep_ms / 1e3) if compute == "sleep" else stage


def _batch(dim: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)  # every rank: the same global batch
    return torch.randn(batch, dim, generator=g), torch.randint(0, 2, (batch,), generator=g)


def _ours(world: World, name: str, cfg: dict, log: dict):
    """A training step of schedule `name` on this rank, and a function that runs one more with
    the activation meter on and returns its peak bytes: everything held (saved activations
    and the interpreter's message buffers), and the saved activations alone. Each timed call appends its compute
    spans (kind, stage, mb, start, end) to log[name].

    The meter's saved-tensor hooks run Python for every tensor autograd saves, which torch's
    contenders do not pay, so timed steps run without them; the peak is the same in any step
    (the program's order of forwards and backwards fixes it), so one metered step gives it."""
    schedule = pipeline.build(name, world.world_size, cfg["microbatches"], cfg["virtual"])
    torch.manual_seed(0)
    stages = pipeline.split_model(FullMLP(cfg["dim"], cfg["depth"]), schedule.stages)
    mine = {s: wrap(stages[s], cfg["compute"], cfg["sleep_ms"])
            for s in schedule.stages_of(world.rank)}
    params = [q for s in mine.values() for q in s.parameters()]
    opt = torch.optim.SGD(params, lr=1e-3)
    x, y = _batch(cfg["dim"], cfg["batch"])
    # The batch is data, held whatever the schedule: micro-batches are views of it, and
    # without this the first one saved would count the whole batch's storage.
    meter = ActivationMeter(exclude=[*params, x, y])
    log[name] = []

    def step() -> None:
        opt.zero_grad()
        record: list = []
        pipeline.run_schedule(schedule, mine, x, y, loss_fn, record=record)
        opt.step()
        log[name].append([(a.kind, a.stage, a.mb, s, e) for a, s, e in record])

    def measure() -> tuple[int, int]:
        opt.zero_grad()
        meter.reset_peak()
        with meter:
            pipeline.run_schedule(schedule, mine, x, y, loss_fn)
        opt.step()
        return meter.peak, meter.peak_saved

    return step, measure


def _torchs(world: World, name: str, cfg: dict, lib=None):
    """The same step with torch.distributed.pipelining's classes (or `lib`'s of the same
    names: microddp.pipeline): PipelineStage per stage, interleaved with --virtual per rank."""
    import torch.distributed.pipelining as torchs

    lib = lib or torchs
    p, rank = world.world_size, world.rank
    v = {"interleaved": cfg["virtual"], "zbv": 2}.get(name, 1)
    torch.manual_seed(0)
    parts = pipeline.split_model(FullMLP(cfg["dim"], cfg["depth"]), p * v)
    mine = [s for s in range(p * v)
            if place(s, p, "v" if name == "zbv" else "loop") == rank]
    modules = [wrap(parts[s], cfg["compute"], cfg["sleep_ms"]) for s in mine]
    stages = [lib.PipelineStage(module, s, p * v, torch.device("cpu"))
              for s, module in zip(mine, modules, strict=True)]
    schedule = getattr(lib, TORCH[name])(stages if name in ("interleaved", "zero-bubble", "zbv")
                                         else stages[0], cfg["microbatches"], loss_fn=loss_fn)
    opt = torch.optim.SGD([q for module in modules for q in module.parameters()], lr=1e-3)
    x, y = _batch(cfg["dim"], cfg["batch"])

    def step() -> None:
        opt.zero_grad()
        if name == "zbv":  # the V puts the first and the last stage on rank 0
            schedule.step(*([x] if rank == 0 else []), target=y if rank == 0 else None)
        else:
            torch_schedule_step(schedule, rank, p, x, y)
        opt.step()

    return step


def torch_schedule_step(schedule, rank: int, p: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """One step of a torch.distributed.pipelining schedule on `rank` of `p`: the first stage
    feeds the batch, the last the targets, the ones between neither (torch's contract)."""
    if rank == 0:
        schedule.step(x)
    elif rank == p - 1:
        schedule.step(target=y)
    else:
        schedule.step()


def _job(world: World, cfg: dict) -> dict:
    torch.set_num_threads(1)  # one core's worth per rank for every contender alike
    if cfg["pinned"]:
        pipeline.placement.pin(world.rank)  # why: pipeline/placement.py
    log: dict = {}
    ours = {name: _ours(world, name, cfg, log) for name in cfg["schedules"]}
    contenders = {name: step for name, (step, _) in ours.items()}
    for name in cfg["torch"]:
        contenders[f"torch-{name}"] = _torchs(world, name, cfg)
        contenders[f"shaped-{name}"] = _torchs(world, name, cfg, pipeline)
    times = interleaved(contenders, cfg["repeats"], cfg["warmup"], sync=dist.barrier)
    # A step is as slow as its slowest rank: the maximum over ranks, step by step.
    names = list(contenders)
    table = torch.tensor([times[n] for n in names], dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    peaks = {}
    for name, (_, measure) in ours.items():  # untimed: the meter's hooks cost time
        dist.barrier()
        peaks[name] = measure()
    return {"times": {n: table[k].tolist() for k, n in enumerate(names)},
            "log": {n: steps[cfg["warmup"]:] for n, steps in log.items()}, "peak": peaks}


def check(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """Refuse bad input before any rank starts; return the schedules and torch's contenders,
    and print why a torch contender is left out."""
    flags.at_least(2, stages=args.stages)
    flags.at_least(1, microbatches=args.microbatches, repeats=args.repeats, dim=args.dim,
                   batch=args.batch, virtual=args.virtual)
    flags.at_least(0, warmup=args.warmup)
    flags.positive("sleep_ms", args.sleep_ms)
    flags.distinct("schedules", args.schedules)
    unknown = [s for s in args.schedules if s not in pipeline.BUILDERS]
    if unknown:
        raise MicroDDPError(f"unknown schedule(s) {', '.join(unknown)}; choose from "
                            f"{', '.join(pipeline.BUILDERS)}")
    if "interleaved" in args.schedules and args.virtual < 2:
        raise MicroDDPError("the interleaved schedule needs --virtual 2 or more")
    virtual = args.virtual if "interleaved" in args.schedules else 1
    pipeline.blocks_per_stage(args.depth, args.stages * virtual)  # raises, saying what to do
    pipeline.microbatch_sizes(args.batch, args.microbatches)
    theirs = [] if args.no_torch else [s for s in TORCH if s in args.schedules
                                       or (s == "zbv" and "zero-bubble" in args.schedules)]
    if "zbv" in theirs and args.depth < 2 * args.stages:
        theirs.remove("zbv")
        print(f"note: ZB-V needs --depth of at least 2 x stages ({2 * args.stages}); left out")
    if "1f1b" in theirs and args.microbatches < args.stages:
        theirs.remove("1f1b")
        print(f"note: torch's Schedule1F1B refuses fewer micro-batches than stages "
              f"({args.microbatches} < {args.stages}); left out")
    for name in [t for t in theirs if t in ("interleaved", "zero-bubble")]:
        rounds = max(1, args.microbatches // args.stages)
        if args.microbatches % rounds:
            theirs.remove(name)
            print(f"note: torch's {TORCH[name]} needs the micro-batches to be a multiple of "
                  f"max(1, m // p) = {rounds}; left out")
    if theirs and args.batch % args.microbatches:
        print(f"note: torch's schedules need equal micro-batches ({args.batch} samples do not "
              f"split into {args.microbatches}); torch left out")
        theirs = []
    return list(args.schedules), theirs


def run(args: argparse.Namespace) -> int:
    """Run `microddp bench pipeline`: time every schedule beside torch's, write the json, PNGs and trace."""
    from ..launch.spawn import spawn

    schedules, theirs = check(args)
    cfg = {"stages": args.stages, "microbatches": args.microbatches, "virtual": args.virtual,
           "dim": args.dim, "depth": args.depth, "batch": args.batch, "compute": args.compute,
           "sleep_ms": args.sleep_ms if args.compute == "sleep" else None,
           "repeats": args.repeats, "warmup": args.warmup, "schedules": schedules,
           "torch": theirs, "pinned": not args.no_pin}
    with outputs.run_folder(args.out, "bench-pipeline") as out:
        load = os.getloadavg()
        ranks = spawn(_job, args.stages, args=(cfg,), backend="gloo", timeout=1800)
        result = report.summarize(cfg, ranks, load)
        print(report.table(result))
        files = report.write(result, ranks, out)
        print(outputs.wrote(files))
    return 0
