"""microddp DDP vs PyTorch DDP vs the naive stage: training step time, side by side.

Every contender trains its own copy of the same FullMLP on the same batches, on the same ranks;
their steps are interleaved (each round in a fresh random order, a barrier before each) so
machine noise hits all alike. Reports the median step time (the slowest rank's, per step) and
the ratio microddp / PyTorch. With --torch-on-microddp, PyTorch's DDP also runs unchanged on a
group of microddp's torch.distributed backend (microddp.backend: shared memory on one host).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

from .. import flags
from ..errors import MicroDDPError
from ..timing import compare, interleaved, median

EPILOG = """\
examples:
  microddp bench ddp                              # dims 128 512 1024, depth 16, 2 ranks
  microddp bench ddp --dims 1024 --repeats 50     # one size, more repetitions
  microddp bench ddp --engines microddp torch overlap --bucket-cap-mb 4
  microddp bench ddp --dims 128 --control         # is a 3% difference real here? (A/A)
  microddp bench ddp --dims 128 1024 --engines torch --torch-on-microddp --control
  microddp bench ddp --dims 128 --engines microddp torch --floor   # how short can a step be?
"""

DEFAULT_ENGINES = ("microddp", "torch", "naive")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `microddp bench ddp`: model widths, batch, ranks, repetitions, engines."""
    p.add_argument("--dims", type=int, nargs="+", default=[128, 512, 1024],
                   help="FullMLP widths to measure (default: 128 512 1024)")
    p.add_argument("--depth", type=int, default=16, help="Linear+ReLU layers (default: 16)")
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step (default: 64)")
    p.add_argument("-n", "--world-size", type=int, default=2, help="ranks (default: 2)")
    p.add_argument("--repeats", type=int, default=30, help="timed steps per contender (default: 30)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default: 5)")
    p.add_argument("--engines", nargs="+", default=list(DEFAULT_ENGINES),
                   help="contenders: microddp torch naive hooks buckets overlap (default: "
                        f"{' '.join(DEFAULT_ENGINES)})")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="bucket size for every contender (default: each one's default, 25 MiB)")
    p.add_argument("--control", action="store_true",
                   help="also time a second, identical PyTorch DDP and print its ratio to the "
                        "first (A/A): how far apart this machine puts two equal contenders")
    p.add_argument("--torch-on-microddp", action="store_true",
                   help=f"also time PyTorch's DDP, unchanged, on a group of the \"microddp\" "
                        f"torch.distributed backend ({ON_MICRODDP}), and print its ratio to "
                        "PyTorch's DDP on gloo")
    p.add_argument("--floor", action="store_true",
                   help="also time, on every rank at once, the same step without DDP "
                        f"({ALONE}: forward, backward, optimizer, nothing exchanged) and that "
                        f"step plus one blocking microddp.comms.all_reduce of the gradients' "
                        f"bytes after backward ({FLOOR}): where backward leaves nothing to "
                        f"overlap (one bucket, filled last), no DDP step is shorter than {FLOOR}")


CONTROL = "torch-2"  # the A/A contender: PyTorch's DDP again, as a separate model
ON_MICRODDP = "torch-mddp"  # PyTorch's DDP on a process group of microddp's backend
ALONE = "no-comm"  # each rank trains its own model: the compute of a step, without DDP
FLOOR = "floor"  # ALONE plus one all-reduce of the gradients' bytes: what DDP cannot avoid


def _microddp_group():
    """A group of every rank on microddp's torch.distributed backend (collective)."""
    from .. import backend

    return dist.new_group(backend=backend.NAME)


def _contender(engine: str, dim: int, depth: int, batch: int, cap: float | None, rank: int,
               group=None):
    from .. import comms
    from ..dp import wrap
    from ..model import FullMLP

    torch.manual_seed(0)
    kwargs = {} if cap is None else {"bucket_cap_mb": cap}
    if engine == ON_MICRODDP:
        kwargs["process_group"] = group
    model = FullMLP(dim, depth)
    if engine not in (ALONE, FLOOR):
        model = wrap(model, "torch" if engine in (CONTROL, ON_MICRODDP) else engine, **kwargs)
    # FLOOR's all-reduce: as many bytes as the gradients, in one flat tensor, no copies
    flat = torch.zeros(sum(p.numel() for p in model.parameters())) if engine == FLOOR else None
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(batch, dim, generator=g)
    y = torch.randint(0, 2, (batch,), generator=g)

    def step() -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if flat is not None:
            comms.all_reduce(flat)
        opt.step()

    return step


def _measure(world, dims, depth, batch, engines, repeats, warmup, cap) -> dict:
    results = {}
    group = _microddp_group() if ON_MICRODDP in engines else None
    for dim in dims:
        contenders = {e: _contender(e, dim, depth, batch, cap, world.rank, group)
                      for e in engines}
        # interleaved() shuffles the order every round: a step runs a little differently
        # right after another contender's step (caches, the network), and no one should
        # always pay that.
        times = interleaved(contenders, repeats, warmup, sync=dist.barrier)
        # A step is as slow as its slowest rank: take the maximum over ranks, step by step.
        table = torch.tensor([times[e] for e in engines], dtype=torch.float64)
        dist.all_reduce(table, op=dist.ReduceOp.MAX)
        results[dim] = {e: table[k].tolist() for k, e in enumerate(engines)}
    return results


def run(args: argparse.Namespace) -> int:
    """Check the flags, time the DDP engines interleaved on spawned ranks, and print their
    ratios; the exit code."""
    from ..launch.spawn import spawn

    flags.engines(args.engines)
    if args.world_size < 2:
        raise MicroDDPError("the DDP benchmark needs at least 2 ranks (-n 2)")
    flags.at_least(1, dims=args.dims, batch=args.batch, repeats=args.repeats)
    flags.at_least(0, depth=args.depth, warmup=args.warmup)
    flags.distinct("dims", args.dims)
    flags.positive("bucket_cap_mb", args.bucket_cap_mb)
    names = (list(args.engines) + ([ON_MICRODDP] if args.torch_on_microddp else [])
             + ([CONTROL] if args.control else []) + ([ALONE, FLOOR] if args.floor else []))
    if args.control and "torch" not in args.engines:
        raise MicroDDPError("--control compares PyTorch's DDP with itself: include torch in "
                            "--engines")
    if args.torch_on_microddp and "torch" not in args.engines:
        raise MicroDDPError("--torch-on-microddp compares PyTorch's DDP on two backends: "
                            "include torch in --engines")
    if args.floor and "torch" not in args.engines:
        raise MicroDDPError("--floor compares the least a step can take with PyTorch's DDP "
                            "step: include torch in --engines")
    results = spawn(_measure, args.world_size, args=(
        args.dims, args.depth, args.batch, names, args.repeats, args.warmup,
        args.bucket_cap_mb), timeout=3600, backend="gloo")[0]  # CPU tensors, even on a GPU host
    print(f"FullMLP depth {args.depth}, batch {args.batch}/rank, {args.world_size} ranks, gloo; "
          f"median of {args.repeats} interleaved steps (slowest rank), ms")
    widths = [max(10, len(e) + 1) for e in names]
    head = "".join(f"{e:>{w}}" for e, w in zip(names, widths, strict=True))
    has_ratio = "microddp" in args.engines and "torch" in args.engines
    print(f"{'dim':>6}{head}" + (f"{'microddp/torch':>16}{'90% interval':>14}" if has_ratio else "")
          + (f"{'mddp/gloo':>10}{'90% interval':>14}" if args.torch_on_microddp else "")
          + (f"{'A/A':>8}{'90% interval':>14}" if args.control else "")
          + (f"{'floor/torch':>13}{'90% interval':>14}" if args.floor else ""))
    for dim, times in results.items():
        row = "".join(f"{median(times[e]) * 1e3:>{w}.2f}"
                      for e, w in zip(names, widths, strict=True))
        if has_ratio:
            row += f"{_versus_torch(times, 'microddp', 15)}"
        if args.torch_on_microddp:
            row += f"{_versus_torch(times, ON_MICRODDP, 9)}"
        if args.control:
            row += f"{_versus_torch(times, CONTROL, 7)}"
        if args.floor:
            row += f"{_versus_torch(times, FLOOR, 12)}"
        print(f"{dim:>6}{row}")
    if args.torch_on_microddp:
        print(f"mddp/gloo = {ON_MICRODDP}/torch: PyTorch's DDP, unchanged, on the \"microddp\" "
              "backend over its own on gloo")
    if args.control:
        print("A/A = torch-2/torch: two identical contenders; a microddp/torch ratio that close "
              "to 1.000 is within this run's noise")
    if args.floor:
        print(f"{ALONE} = every rank trains alone (no DDP, nothing exchanged); {FLOOR} = that step "
              "plus one blocking microddp.comms.all_reduce of the gradients' bytes\n  after "
              "backward: where backward leaves nothing to overlap (one bucket, filled last), no "
              "DDP step is shorter,\n  so floor/torch is the least microddp/torch this host "
              f"allows there; {ALONE}/{FLOOR} bounds weak-scaling efficiency the same way")
    if has_ratio or args.control or args.torch_on_microddp or args.floor:
        print("90% interval = where the ratio lands when this run's rounds are drawn again (a "
              "bootstrap)")
    return 0


def _versus_torch(times: dict[str, list[float]], name: str, width: int) -> str:
    """`name`'s median step time over PyTorch DDP's, and its 90% bootstrap interval (steps of
    one round paired), as table cells."""
    ratio, (lo, hi) = compare(times[name], times["torch"])
    return f"{ratio:>{width}.3f}x{lo:>8.3f}-{hi:.3f}"
