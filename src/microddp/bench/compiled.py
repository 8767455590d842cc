"""microddp's DDP against PyTorch's under torch.compile: the compiled training step, side by side.

Each engine wraps its own compiled copy of the same model, `DDP(torch.compile(model))`, on the
same ranks and batch; after a warm-up (the compile itself, then three steps) their steps are
interleaved, a barrier before each, alternating which goes first, and the median step of
each is reported with the ratio microddp / PyTorch, per rank. Both split the compiled graph by
bucket (dynamo's DDPOptimizer: dp/compiled.py), so communication overlaps the compiled
backward in both. `--backend none` times the same models uncompiled, for the eager ratio.

    microddp bench compiled --backend inductor --rounds 30

The first compile's time is printed too, but it is not a comparison: the engine compiled
second finds the first one's kernels in inductor's cache.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from .. import flags
from ..dp import DistributedDataParallel
from ..errors import MicroDDPError
from ..launch.spawn import spawn

EPILOG = """\
examples:
  microddp bench compiled                          # inductor, 2 ranks, 30 interleaved steps
  microddp bench compiled --backend none           # the same models uncompiled (eager ratio)
  microddp bench compiled --backend aot_eager --rounds 10
"""

ENGINES = ("microddp", "torch")


def model() -> nn.Module:
    """Five layers, 2.3 MiB of float32 parameters: four buckets of 1 MiB once rebuilt."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(),
                         nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(),
                         nn.Linear(512, 10))


def _build(engine: str, backend: str):
    net = model()
    cls = DistributedDataParallel if engine == "microddp" else nn.parallel.DistributedDataParallel
    ddp = cls(net if backend == "none" else torch.compile(net, backend=backend), bucket_cap_mb=1)
    return ddp, torch.optim.SGD(net.parameters(), lr=0.01)


def _step(ddp, opt, x, y) -> float:
    dist.barrier()
    t = time.perf_counter()
    opt.zero_grad()
    nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()
    return time.perf_counter() - t


def _run(world, backend: str, rounds: int) -> dict:
    g = torch.Generator().manual_seed(world.rank)
    x, y = torch.randn(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g)
    runs, first = {}, {}
    for engine in ENGINES:
        runs[engine] = _build(engine, backend)
        first[engine] = _step(*runs[engine], x, y)
        for _ in range(3):
            _step(*runs[engine], x, y)
    times: dict[str, list[float]] = {e: [] for e in ENGINES}
    for r in range(rounds):
        for engine in (ENGINES if r % 2 == 0 else ENGINES[::-1]):
            times[engine].append(_step(*runs[engine], x, y))
    medians = {e: statistics.median(v) for e, v in times.items()}
    return {"first": first, "median": medians, "ratio": medians["microddp"] / medians["torch"]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `microddp bench compiled`."""
    p.add_argument("--backend", default="inductor",
                   help="torch.compile backend (inductor, aot_eager, eager), or none for the "
                        "uncompiled models (default: inductor)")
    p.add_argument("--rounds", type=int, default=30,
                   help="interleaved timed steps per engine (default: 30)")


def run(args: argparse.Namespace) -> int:
    """Check the flags, run the comparison on 2 ranks and print one line per rank."""
    flags.at_least(1, rounds=args.rounds)
    if args.backend != "none":
        import torch._dynamo

        known = torch._dynamo.list_backends(exclude_tags=())
        if args.backend not in known:
            raise MicroDDPError(f"--backend {args.backend}: not a torch.compile backend; choose "
                                "none, inductor, aot_eager, eager, or another name that "
                                "torch._dynamo.list_backends() prints")
    for rank, out in enumerate(spawn(_run, 2, args=(args.backend, args.rounds), timeout=1800)):
        f, m = out["first"], out["median"]
        print(f"rank {rank} {args.backend}: median step microddp {m['microddp'] * 1e3:.2f} ms, "
              f"torch {m['torch'] * 1e3:.2f} ms, ratio {out['ratio']:.3f} (first step "
              f"{f['microddp']:.1f} s, {f['torch']:.1f} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m microddp.bench.compiled`: the same as `microddp bench compiled`."""
    p = argparse.ArgumentParser(prog="python -m microddp.bench.compiled",
                                description=__doc__.split("\n")[0], epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    try:
        return run(p.parse_args(argv))
    except MicroDDPError as e:
        print(f"error: {e}")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
