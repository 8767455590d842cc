"""Where a small all-reduce through shared memory spends its time: each step of the default
path of `microddp.comms.all_reduce`, timed on its own, beside the whole call.

    python -m microddp.bench.shm_profile            # 2 ranks, 4 KiB and 64 KiB
    python -m microddp.bench.shm_profile 4K 1M      # other sizes

The whole call is timed back to back on both ranks at once (K calls in a row, time per call,
the median of rounds), with the hang monitor on, as `microddp.init` leaves it. Every step that
needs no peer (the argument checks, the route, the agreement's numbers, the lane, the copies
and adds) is timed in a loop on rank 0 alone, between two rounds; the rest of the call (the
two ranks meeting in the segment, and what the steps cost together that they do not alone)
is the difference. The steps are the ones `all_reduce` takes today: when the path changes,
this list changes with it (chapter 4c shows its table).
"""

from __future__ import annotations

import sys
import time

import torch

from .. import comms
from ..launch.spawn import spawn
from ..timing import median

K = 200  # calls in a row per round
ROUNDS = 15


def _per_call(fn, n: int = 2000) -> float:
    """Median over 5 loops of `n` calls of `fn`: CPU seconds of this thread per call (on a
    loaded host the wall clock also counts the time slices other processes took)."""
    out = []
    for _ in range(5):
        start = time.thread_time()
        for _ in range(n):
            fn()
        out.append((time.thread_time() - start) / n)
    return median(out)


def steps(t: torch.Tensor) -> dict[str, float]:
    """Each step of the default path timed alone on this rank (no peer needed)."""
    from ..collectives import route
    from ..comms import ops
    from ..monitor import patch
    from ..shm import checked
    from ..shm import collectives as shm
    from ..shm.group import fold_into
    from ..world.world import distributed, given_group

    state = shm.shared(None)
    g = state.group
    flat = shm.flat_data(t)
    cut = g.cut(t.dtype, t.numel())[0]
    out: dict[str, float] = {}
    out["monitor wrapper (log begin/end)"] = _monitor_cost(patch)
    out["comms: argument checks"] = _per_call(lambda: ops._all_reduce_problem(t, "sum"))
    out["comms: given_group, distributed"] = _per_call(lambda: (given_group(None), distributed()))
    out["route: all_reduce_path"] = _per_call(lambda: route.all_reduce_path(t, "sum", None))
    out["shm: shared(group), flat view"] = _per_call(lambda: (shm.shared(None),
                                                               shm.flat_data(t)))
    out["agreement: the call's numbers"] = _per_call(
        lambda: checked.all_reduce_check(g.agreement, None, t, "sum"))
    out["lane: run_now (empty task)"] = _per_call(lambda: state.lane.run_now(lambda: None))
    out["group: step, cut"] = _per_call(lambda: g.cut(t.dtype, t.numel()))
    out["copy into the slot"] = _per_call(_copy(cut.inputs[g.rank], flat))
    out["post (write numbers, counter, fence)"] = _post_cost(g)
    out["add the peer's slot"] = _per_call(lambda: fold_into("sum", cut.inputs, flat, 1))
    return out


def _monitor_cost(patch) -> float:
    """The hang monitor's wrapper around a function that does nothing, as it wraps the route
    (lean: monitor/patch.py's `leanly`, where this version of it has one)."""
    mon = patch.active()
    if mon is None:
        return 0.0

    def nothing(tensor, op="sum", group=None, async_op=False):
        return None
    nothing.ends_itself = nothing.lean = True
    try:
        wrapped = patch._wrap("all_reduce", nothing, torch_own=True, lean=True)
    except TypeError:  # a version without the lean log
        wrapped = patch._wrap("all_reduce", nothing, torch_own=True)
    t = torch.zeros(1)
    return _per_call(lambda: wrapped(t, "sum", None, False))


def _copy(slot: torch.Tensor, flat: torch.Tensor):
    """The copy into the slot as group.py makes it (a memmove up to MEMMOVE_BYTES)."""
    from ..shm import group
    nbytes = flat.numel() * flat.element_size()
    if nbytes <= getattr(group, "MEMMOVE_BYTES", -1):
        return lambda: group._memmove(slot.data_ptr(), flat.data_ptr(), nbytes)
    return lambda: slot.copy_(flat)


def _post_cost(g) -> float:
    """What a post costs (the agreement's numbers into this rank's line, its counter, the bell,
    the fence), on a row of counters nobody waits on: the `reduced` row's counter is set back
    after, so the group stays in step."""
    flags = g.reduced
    before = flags.get(g.rank)
    words = g.agreement.words
    mine = g.agreement.__dict__.get("_checks", {})
    numbers = next(iter(mine.values())).mine if mine else None
    at = g.agreement.lines[0][g.rank]

    def post() -> None:
        if numbers is not None:
            words[at:at + len(numbers)] = numbers
        flags.post(before)

    return _per_call(post)


def _setting(name: str, state) -> None:
    """Put the path in one of the SETTINGS (every rank at once: the calls stay in step)."""
    from ..monitor import patch
    from ..shm import checked, segment
    g = state.group
    rows = (g.arrive, g.reduced, g.agreement.told)
    if patch.active() is not None and "monitor" in name:
        _setting.mon = patch.uninstall()
    elif patch.active() is None and "monitor" not in name and getattr(_setting, "mon", None):
        patch.install(_setting.mon)
    checked.CHECKING = "check" not in name
    for flags in rows:  # "sleep at once": the wait before the adaptive spin (SPINS reads)
        least = getattr(segment, "SPIN_MIN_S", 0.0)  # 0: a version without the spin
        flags.spin_s = 0.0 if "sleep" in name else max(getattr(flags, "spin_s", 0.0), least)


SETTINGS = ("default", "default, sleeping at once", "no monitor", "no monitor, no check")


def _whole(t: torch.Tensor, state) -> dict[str, tuple[float, float]]:
    """comms.all_reduce(t), K in a row on both ranks, in each of SETTINGS, the settings
    interleaved round by round in an order drawn afresh each round (the same on every rank):
    (wall, CPU) seconds per call, medians over ROUNDS rounds. The CPU time is this rank's own
    work (and its spins and system calls): what the wall time shows on an idle host."""
    import random
    order = random.Random(0)
    wall: dict[str, list[float]] = {n: [] for n in SETTINGS}
    cpu: dict[str, list[float]] = {n: [] for n in SETTINGS}
    for _ in range(ROUNDS):
        for name in order.sample(SETTINGS, len(SETTINGS)):
            _setting(name, state)
            for _ in range(10):
                comms.all_reduce(t)
            comms.barrier()
            start, start_cpu = time.perf_counter(), time.thread_time()
            for _ in range(K):
                comms.all_reduce(t)
            cpu[name].append((time.thread_time() - start_cpu) / K)
            wall[name].append((time.perf_counter() - start) / K)
    _setting("default", state)
    return {n: (median(wall[n]), median(cpu[n])) for n in SETTINGS}


def _rank(world, sizes: list[int]):
    from ..shm import collectives as shm
    rows = []
    for nbytes in sizes:
        t = torch.zeros(nbytes // 4)
        for _ in range(20):
            comms.all_reduce(t)
        whole = _whole(t, shm.shared(None))
        comms.barrier()
        parts = steps(t) if world.rank == 0 else None
        comms.barrier()
        rows.append((nbytes, whole, parts))
    return rows if world.rank == 0 else None


def main(argv: list[str]) -> int:
    """`python -m microddp.bench.shm_profile 4K 64K`: the path's steps timed at each size."""
    from .allreduce import parse_size
    sizes = [parse_size(s) for s in (argv or ["4K", "64K"])]
    rows = spawn(_rank, 2, (sizes,), timeout=600, backend="gloo")[0]
    for nbytes, whole, parts in rows:
        print(f"\n{nbytes // 1024} KiB, comms.all_reduce {K} in a row on 2 ranks "
              f"(median of {ROUNDS} rounds), rank 0:")
        for name, (wall, cpu) in whole.items():
            print(f"  {name:<40} wall {wall * 1e6:7.2f} us  CPU {cpu * 1e6:7.2f} us")
        print("  each step alone (CPU us per call):")
        for name, s in parts.items():
            print(f"    {name:<38} {s * 1e6:7.2f}")
        rest = whole["default"][1] - sum(parts.values())
        print(f"    {'the rest (frames between, waiting)':<38} {rest * 1e6:7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
