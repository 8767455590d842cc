"""Flat vs hierarchical all-reduce across hosts, side by side: run on every host under torchrun.

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank $NODE_RANK --master-addr $HOST0 \\
             --master-port 29400 -m microddp.bench.hierarchical

Flat is what DDP does without a hierarchy: gloo's all_reduce over the whole world. Hierarchical
is collectives.hierarchical over the real hosts. Each size times both (and, with --control, a
second flat one: the A/A) interleaved in random order, a barrier before each call; a call's
time is the slowest rank's. Rank 0 prints median times and the ratio flat / hierarchical with a
90% bootstrap interval: above 1, hierarchical is faster.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

from .. import comms
from ..collectives.hierarchical import discover
from ..timing import compare, interleaved, median

SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The benchmark's flags."""
    p = argparse.ArgumentParser(prog="python -m microddp.bench.hierarchical",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES),
                   help="tensor sizes in bytes (default 4 KiB .. 16 MiB)")
    p.add_argument("--repeats", type=int, default=30, help="timed calls each (default 30)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first (default 3)")
    p.add_argument("--control", action="store_true", help="also flat against flat (A/A)")
    return p.parse_args(argv)


def _slowest(times: list[float]) -> list[float]:
    """Per call, the slowest rank's time: the collective is done when the last rank is."""
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, dist.ReduceOp.MAX)
    return t.tolist()


def measure(sizes: list[int], repeats: int, warmup: int, control: bool) -> list[dict]:
    """Flat (gloo) against hierarchical all-reduce per size, interleaved; the slowest rank's medians."""
    hierarchy = discover()
    rows = []
    for nbytes in sizes:
        data = {k: torch.ones(nbytes // 4) for k in ("flat", "hier", "flat-2")}
        contenders = {
            "flat": lambda d=data["flat"]: dist.all_reduce(d),
            "hier": lambda d=data["hier"]: hierarchy.all_reduce_(d),
        }
        if control:
            contenders["flat-2"] = lambda d=data["flat-2"]: dist.all_reduce(d)
        times = {k: _slowest(v) for k, v in
                 interleaved(contenders, repeats, warmup, sync=dist.barrier).items()}
        ratio, (lo, hi) = compare(times["flat"], times["hier"])
        row = {"bytes": nbytes, "flat_ms": 1e3 * median(times["flat"]),
               "hier_ms": 1e3 * median(times["hier"]), "ratio": ratio, "low": lo, "high": hi}
        if control:
            row["aa"] = compare(times["flat"], times["flat-2"])[0]
        rows.append(row)
    return rows


def table(rows: list[dict], hosts: int, world: int) -> str:
    """The printed table: flat and hierarchical time per size, their ratio and its interval."""
    head = f"{'bytes':>10} {'flat ms':>9} {'hier ms':>9} {'flat/hier':>9} {'90% interval':>14}"
    control = "aa" in rows[0]
    out = [f"all-reduce over {world} ranks on {hosts} hosts (slowest rank, median)",
           head + (f" {'A/A':>6}" if control else "")]
    for r in rows:
        interval = f"{r['low']:.2f}-{r['high']:.2f}"
        out.append(f"{r['bytes']:>10} {r['flat_ms']:>9.3f} {r['hier_ms']:>9.3f} "
                   f"{r['ratio']:>9.2f} {interval:>14}" + (f" {r['aa']:>6.2f}" if control else ""))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark on every rank of a torchrun job; rank 0 prints the table."""
    args = parse(argv)
    world = comms.init()
    try:
        rows = measure(args.sizes, args.repeats, args.warmup, args.control)
        if world.rank == 0:
            print(table(rows, discover().hosts, world.world_size), flush=True)
    finally:
        comms.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
