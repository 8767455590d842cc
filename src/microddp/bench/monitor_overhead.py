"""What the default monitor costs: the same work with it on and off, interleaved in one run.

    python -m microddp.bench.monitor_overhead                 # DDP steps, all_reduce 4 KiB and 4 MiB
    python -m microddp.bench.monitor_overhead --repeats 60 --dims 128 1024
    python -m microddp.bench.monitor_overhead --interrupt     # the monitor that waits with its timeout
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..launch.spawn import spawn
from ..monitor import Monitor, disable, enable, patch, stall_seconds
from ..timing import compare, median

# How the two costs are measured apart, each against an A/A control ("off-2"):
#
# The monitor costs two things, measured apart, each against an A/A control ("off-2": off
# again, how far apart this machine puts two equal contenders):
#
# - per call: every collective goes through a wrapper that notes it. In a job the watchdog
#   thread starts once, at init(), and stays; so here one monitor is started before the
#   measurement and runs throughout, and only its wrappers go in ("on") or out ("off",
#   "off-2") before each timed call, in a fresh random order per round, a barrier before each.
#   (Starting a monitor per round, as this benchmark once did, timed a new thread's start-up,
#   which a job pays once.)
# - the watchdog thread: with the wrappers out, the thread running ("on") against no thread
#   ("off", "off-2"). Starting or stopping it between calls would time its start-up again, so
#   the states come in blocks, in a fresh random order per round of blocks: the thread is
#   started (or not) outside the timed region, given THREAD_SETTLE_S to reach its wait, then a
#   block runs calls back to back, each after a barrier, no sleep between them (a sleep would
#   give the thread idle time to poll in, hiding its cost). A block lasts at least
#   POLLS_PER_BLOCK of the thread's poll periods, so each "on" block holds the polls a job
#   sees in that time, in steady state; then the thread is stopped, outside the timed region.
#
# Per workload it prints on/off and off-2/off as ratios of medians of the slowest rank's times,
# with a 90% bootstrap interval. The DDP step is `microddp bench ddp`'s (microddp's DDP,
# FullMLP(dim, depth 16), batch 64 per rank, SGD). "on" is the monitor init() starts for the
# ranks' process group (its stall threshold, its waits); with --interrupt, the one that waits on
# blocking gloo calls with its own timeout (enable(interrupt=True)).

STATES = ("on", "off", "off-2")
GROUP_TIMEOUT_S = 3600.0  # spawn's deadline, and so the ranks' process group timeout
STALL_S = stall_seconds(GROUP_TIMEOUT_S)  # what init() picks for that process group
THREAD_SETTLE_S = 0.2  # after a thread starts (or not, alike), before a block is timed
POLLS_PER_BLOCK = 2  # a thread block lasts this many of its poll periods at least


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


def _timed(work: Callable[[], None]) -> float:
    dist.barrier()
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def _slowest(times: dict[str, list[float]]) -> dict[str, list[float]]:
    """The slowest rank's time per sample: a step is over when every rank is done."""
    out = {}
    for state, xs in times.items():
        t = torch.tensor(xs, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[state] = t.tolist()
    return out


def _per_call(work: Callable[[], None], mon: Monitor, repeats: int,
              warmup: int) -> dict[str, list[float]]:
    """The wrappers in or out per round; `mon`'s watchdog runs throughout."""
    times: dict[str, list[float]] = {s: [] for s in STATES}
    order = random.Random(0)  # the same order on every rank: collectives must line up
    for i in range(warmup + repeats):
        for state in order.sample(STATES, len(STATES)):
            if state == "on":
                patch.install(mon)
            else:
                patch.uninstall()
            t = _timed(work)
            if i >= warmup:
                times[state].append(t)
    patch.uninstall()
    return _slowest(times)


def _thread(work: Callable[[], None], repeats: int, warmup: int,
            interrupt: bool | None) -> tuple[dict[str, list[float]], int]:
    """The watchdog thread running or not, in blocks (module docstring); wrappers out.
    Returns the times and the calls per block."""
    for _ in range(warmup):
        _timed(work)
    # Calls per block: enough for POLLS_PER_BLOCK polls on the slowest rank (the same number
    # on every rank: collectives must line up).
    probe = enable(timeout=STALL_S, interrupt=interrupt)
    patch.uninstall()
    poll_s = probe.poll_s
    took = torch.tensor([min(_timed(work) for _ in range(3))], dtype=torch.float64)
    probe.close()
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    per_block = max(5, math.ceil(POLLS_PER_BLOCK * poll_s / max(took.item(), 1e-6)))
    blocks = max(4, math.ceil(repeats / per_block))
    times: dict[str, list[float]] = {s: [] for s in STATES}
    order = random.Random(1)
    for _ in range(blocks):
        for state in order.sample(STATES, len(STATES)):
            mon = None
            if state == "on":
                mon = enable(timeout=STALL_S, interrupt=interrupt)
                patch.uninstall()  # the thread alone
            time.sleep(THREAD_SETTLE_S)
            for _ in range(per_block):
                times[state].append(_timed(work))
            if mon is not None:
                mon.close()
    return _slowest(times), per_block


def _measure(world, dims: list[int], repeats: int, warmup: int,
             interrupt: bool | None) -> tuple[str, list[tuple]]:
    disable()  # init()'s own monitor: this benchmark starts the ones it compares
    mon = enable(timeout=STALL_S, interrupt=interrupt)
    mode = (f"stall threshold {mon.timeout_s:g} s, watchdog polls every {mon.poll_s:g} s, "
            + ("blocking gloo waits interrupted at it" if mon.interrupt else
               "waits left to the process group (as init() starts it)"))
    patch.uninstall()  # the thread stays; the wrappers go in and out per round
    works = [(f"DDP step, FullMLP({dim}, 16)", 1, _ddp_step(dim, world.rank)) for dim in dims]
    works += [(label, calls, _all_reduce(nbytes, calls))
              for nbytes, calls, label in ((4096, 20, "all_reduce 4 KiB"),
                                           (4 << 20, 2, "all_reduce 4 MiB"))]
    rows = [(label, calls, _per_call(work, mon, repeats, warmup)) for label, calls, work in works]
    mon.close()
    threads = [(label, calls, *_thread(work, repeats, warmup, interrupt))
               for label, calls, work in works]
    return mode, [rows, threads]


def _table(title: str, rows: list[tuple]) -> None:
    print(title)
    print(f"{'workload':30} {'off ms':>9} {'on ms':>9} {'on/off':>20} {'off-2/off (A/A)':>20}")
    for label, calls, t, *_ in rows:
        r, (lo, hi) = compare(t["on"], t["off"])
        c, (clo, chi) = compare(t["off-2"], t["off"])
        print(f"{label:30} {1e3 * median(t['off']) / calls:9.3f} "
              f"{1e3 * median(t['on']) / calls:9.3f} {f'{r:.3f} [{lo:.3f}-{hi:.3f}]':>20} "
              f"{f'{c:.3f} [{clo:.3f}-{chi:.3f}]':>20}")


def main(argv: list[str] | None = None) -> None:
    """Measure what the hang monitor costs a DDP step and a bare all-reduce (`python -m
    microddp.bench.monitor_overhead`)."""
    p = argparse.ArgumentParser(prog="python -m microddp.bench.monitor_overhead",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--dims", type=int, nargs="+", default=[128, 1024],
                   help="FullMLP widths for the DDP step (default: 128 1024)")
    p.add_argument("--repeats", type=int, default=30,
                   help="timed rounds per comparison (default: 30)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default: 3)")
    p.add_argument("-n", "--world-size", type=int, default=2, help="ranks (default: 2)")
    p.add_argument("--interrupt", action="store_true",
                   help="measure the monitor that waits on blocking gloo calls with its own "
                        "timeout (enable(interrupt=True)) instead of init()'s (default: off)")
    args = p.parse_args(argv)
    mode, (rows, threads) = spawn(_measure, args.world_size,
                                  args=(args.dims, args.repeats, args.warmup,
                                        args.interrupt or None),
                                  timeout=GROUP_TIMEOUT_S)[0]
    print(f"{args.world_size} ranks; ratio of medians [90% interval]; monitor: {mode}")
    _table(f"per call: wrappers in (on) or out, watchdog running throughout; "
           f"{args.repeats} rounds", rows)
    per_block = ", ".join(f"{n}" for *_, n in threads)
    _table(f"watchdog thread: running (on) or stopped, wrappers out; blocks of "
           f"{per_block} calls", threads)


if __name__ == "__main__":
    main()
