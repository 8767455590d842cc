"""What the default monitor costs: the same work with it on and off, interleaved in one run.

    python -m microddp.bench.monitor_overhead                 # DDP steps, all_reduce 4 KiB and 4 MiB
    python -m microddp.bench.monitor_overhead --repeats 60 --dims 128 1024
    python -m microddp.bench.monitor_overhead --interrupt     # the monitor that waits with its timeout

Each round runs "on", "off" and "off-2" (off again: the A/A control, how far apart this machine
puts two equal contenders) in a fresh random order, the monitor switched before each and a
barrier before each timed call. Per workload it prints on/off and off-2/off as ratios of
medians of the slowest rank's times, with a 90% bootstrap interval. The DDP step is `microddp
bench ddp`'s (microddp's DDP, FullMLP(dim, depth 16), batch 64 per rank, SGD). "on" is the
monitor init() starts for the ranks' process group (its stall threshold, its waits); with
--interrupt, the one that waits on blocking gloo calls with its own timeout (enable(interrupt=True)).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..launch.spawn import spawn
from ..monitor import disable, enable, stall_seconds
from ..timing import compare, median

STATES = ("on", "off", "off-2")
GROUP_TIMEOUT_S = 3600.0  # spawn's deadline, and so the ranks' process group timeout
STALL_S = stall_seconds(GROUP_TIMEOUT_S)  # what init() picks for that process group


def _ddp_step(dim: int, rank: int) -> Callable[[], None]:
    from ..dp import wrap
    from ..model import FullMLP

    torch.manual_seed(0)
    model = wrap(FullMLP(dim, 16), "microddp")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1 + rank)
    x, y = torch.randn(64, dim, generator=g), torch.randint(0, 2, (64,), generator=g)

    def step() -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def _all_reduce(nbytes: int, calls: int) -> Callable[[], None]:
    from .. import comms

    t = torch.ones(nbytes // 4)

    def run() -> None:
        for _ in range(calls):  # several calls per sample: one 4 KiB call is near the clock's grain
            comms.all_reduce(t)

    return run


SETTLE_S = 0.02


def _switch(state: str, interrupt: bool | None) -> None:
    if state == "on":
        enable(timeout=STALL_S, interrupt=interrupt)
    else:
        disable()
    # A watchdog thread just started still takes the GIL a few times on its way to its first
    # wait; on a loaded machine, a thread preempted while holding it stalls the timed calls by
    # a time slice. In a job it starts once, at init(): let it settle (every state alike).
    time.sleep(SETTLE_S)


def _time(work: Callable[[], None], repeats: int, warmup: int,
          interrupt: bool | None) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {s: [] for s in STATES}
    order = random.Random(0)  # the same order on every rank: collectives must line up
    for i in range(warmup + repeats):
        for state in order.sample(STATES, len(STATES)):
            _switch(state, interrupt)
            dist.barrier()
            start = time.perf_counter()
            work()
            if i >= warmup:
                times[state].append(time.perf_counter() - start)
    disable()
    # The slowest rank's time per sample: a step is over when every rank is done.
    for state, xs in times.items():
        t = torch.tensor(xs, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times[state] = t.tolist()
    return times


def _measure(world, dims: list[int], repeats: int, warmup: int,
             interrupt: bool | None) -> tuple[str, list[tuple]]:
    mon = enable(timeout=STALL_S, interrupt=interrupt)
    mode = (f"stall threshold {mon.timeout_s:g} s, "
            + ("blocking gloo waits interrupted at it" if mon.interrupt else
               "waits left to the process group (as init() starts it)"))
    disable()
    rows = []
    for dim in dims:
        rows.append((f"DDP step, FullMLP({dim}, 16)", 1, _time(_ddp_step(dim, world.rank),
                                                               repeats, warmup, interrupt)))
    for nbytes, calls, label in ((4096, 20, "all_reduce 4 KiB"), (4 << 20, 2, "all_reduce 4 MiB")):
        rows.append((label, calls, _time(_all_reduce(nbytes, calls), repeats, warmup,
                                         interrupt)))
    return mode, rows


def main(argv: list[str] | None = None) -> None:
    """Measure what the hang monitor costs a DDP step and a bare all-reduce (`python -m
    microddp.bench.monitor_overhead`)."""
    p = argparse.ArgumentParser(prog="python -m microddp.bench.monitor_overhead",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--dims", type=int, nargs="+", default=[128, 1024],
                   help="FullMLP widths for the DDP step (default: 128 1024)")
    p.add_argument("--repeats", type=int, default=30, help="timed rounds (default: 30)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default: 3)")
    p.add_argument("-n", "--world-size", type=int, default=2, help="ranks (default: 2)")
    p.add_argument("--interrupt", action="store_true",
                   help="measure the monitor that waits on blocking gloo calls with its own "
                        "timeout (enable(interrupt=True)) instead of init()'s (default: off)")
    args = p.parse_args(argv)
    mode, rows = spawn(_measure, args.world_size,
                       args=(args.dims, args.repeats, args.warmup, args.interrupt or None),
                       timeout=GROUP_TIMEOUT_S)[0]
    print(f"{args.world_size} ranks, {args.repeats} rounds; ratio of medians [90% interval]; "
          f"monitor: {mode}")
    print(f"{'workload':30} {'off ms':>9} {'on ms':>9} {'on/off':>20} {'off-2/off (A/A)':>20}")
    for label, calls, t in rows:
        r, (lo, hi) = compare(t["on"], t["off"])
        c, (clo, chi) = compare(t["off-2"], t["off"])
        print(f"{label:30} {1e3 * median(t['off']) / calls:9.3f} "
              f"{1e3 * median(t['on']) / calls:9.3f} {f'{r:.3f} [{lo:.3f}-{hi:.3f}]':>20} "
              f"{f'{c:.3f} [{clo:.3f}-{chi:.3f}]':>20}")


if __name__ == "__main__":
    main()
