"""Flat vs hierarchical all-reduce across hosts, side by side: run on every host under torchrun.

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank $NODE_RANK --master-addr $HOST0 \\
             --master-port 29400 -m microddp.bench.hierarchical

Flat is what DDP does without a hierarchy: gloo's all_reduce over the whole world. Hierarchical
is collectives.hierarchical over the real hosts, its steps inside a host on gloo's send/recv
("hier") and, where the host's ranks share memory, on shared memory ("hier+shm", what DDP
takes). Each size times all of them (and, with --control, a second flat one: the A/A)
interleaved in random order, a barrier before each call; a call's time is the slowest rank's.
Rank 0 prints median times and the ratios flat / each with a 90% bootstrap interval: above 1,
that one is faster than flat.
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
    """Flat (gloo) against hierarchical all-reduce (inside a host: gloo, shared memory) per
    size, interleaved; the slowest rank's medians."""
    hierarchy = discover()
    rows = []
    for nbytes in sizes:
        data = {k: torch.ones(nbytes // 4) for k in ("flat", "hier", "shm", "flat-2")}
        contenders = {
            "flat": lambda d=data["flat"]: dist.all_reduce(d),
            "hier": lambda d=data["hier"]: hierarchy.all_reduce_(d, shm=False),
            "shm": lambda d=data["shm"]: hierarchy.all_reduce_(d),
        }
        if control:
            contenders["flat-2"] = lambda d=data["flat-2"]: dist.all_reduce(d)
        times = {k: _slowest(v) for k, v in
                 interleaved(contenders, repeats, warmup, sync=dist.barrier).items()}
        row = {"bytes": nbytes}
        for k in ("flat", "hier", "shm"):
            row[f"{k}_ms"] = 1e3 * median(times[k])
        for k in ("hier", "shm"):
            ratio, (lo, hi) = compare(times["flat"], times[k])
            row[k] = (ratio, lo, hi)
        if control:
            row["aa"] = compare(times["flat"], times["flat-2"])[0]
        rows.append(row)
    return rows


def table(rows: list[dict], hosts: int, world: int) -> str:
    """The printed table: each one's time per size, flat / each ratio and its interval."""
    head = (f"{'bytes':>10} {'flat ms':>9} {'hier ms':>9} {'+shm ms':>9} {'flat/hier':>9} "
            f"{'90% interval':>13} {'flat/+shm':>9} {'90% interval':>13}")
    control = "aa" in rows[0]
    out = [f"all-reduce over {world} ranks on {hosts} hosts (slowest rank, median; hier: "
           "inside a host on gloo, +shm: on shared memory)",
           head + (f" {'A/A':>6}" if control else "")]
    for r in rows:
        cells = "".join(f" {r[k][0]:>9.2f} {f'{r[k][1]:.2f}-{r[k][2]:.2f}':>13}"
                        for k in ("hier", "shm"))
        out.append(f"{r['bytes']:>10} {r['flat_ms']:>9.3f} {r['hier_ms']:>9.3f} "
                   f"{r['shm_ms']:>9.3f}{cells}" + (f" {r['aa']:>6.2f}" if control else ""))
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
