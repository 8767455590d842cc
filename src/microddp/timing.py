"""Honest timing on a noisy machine: interleave the contenders, repeat, compare medians."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

import torch


def interleaved(contenders: dict[str, Callable[[], object]], repeats: int,
                warmup: int = 2, sync: Callable[[], object] | None = None) -> dict[str, list[float]]:
    """Time each contender `repeats` times, round-robin, so drift in machine load hits all alike.

    Each round runs them in a fresh random order, the same on every rank (a fixed seed):
    a step runs differently right after another contender's (caches, the allocator, the
    network), and with a fixed or merely rotating order, each contender would always follow
    the same one. Measured: with three contenders in rotating order, two copies of PyTorch's
    DDP came out 0.90 to 1.09 of each other from run to run.

    `sync` (e.g. a barrier) runs before each timed call so that every rank starts together.
    Returns seconds per call for each contender.
    """
    times: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    order = random.Random(0)  # same seed on every rank: collectives must line up
    for i in range(warmup + repeats):
        for name in order.sample(names, len(names)):
            fn = contenders[name]
            if sync is not None:
                sync()
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            if i >= warmup:
                times[name].append(elapsed)
    return times


def median(xs: list[float]) -> float:
    """The median of `xs`: what benchmarks compare, as it ignores rare outliers."""
    return statistics.median(xs)


def trimmed_mean(xs: list[float], cut: float = 0.1) -> float:
    """The mean of `xs` after dropping `cut` of the values (to the nearest one) at each end.

    What to hold a cost model to: its rounds add up to a mean time, and a trimmed mean stays
    close to the mean while one stalled call cannot move it far. A median jumps when calls
    take one of two times, as small all-reduces on 4 ranks do here (chapter 4).
    """
    if not xs or not 0 <= cut < 0.5:
        raise ValueError(f"need at least one time and 0 <= cut < 0.5, got {len(xs)} times and "
                         f"cut {cut}")
    s = sorted(xs)
    # To the nearest call (9 calls still lose their worst one), but always keep one.
    k = min(int(cut * len(s) + 0.5), (len(s) - 1) // 2)
    return statistics.fmean(s[k:len(s) - k])


def ratio_of_medians(a: list[float], b: list[float]) -> float:
    """median(a) / median(b): below 1 means `a` is faster."""
    return statistics.median(a) / statistics.median(b)


def compare(a: list[float], b: list[float]) -> tuple[float, tuple[float, float]]:
    """How `a` timed against `b` in one interleaved run: ratio_of_medians(a, b), and its 90%
    ratio_interval (how far the run's own scatter could move it)."""
    return ratio_of_medians(a, b), ratio_interval(a, b)


def ratio_interval(a: list[float], b: list[float], level: float = 0.9, resamples: int = 2000,
                   seed: int = 0) -> tuple[float, float]:
    """A bootstrap interval for ratio_of_medians(a, b), where a[i] and b[i] were timed in the
    same round of `interleaved` (the lists must be equally long).

    Rounds are resampled whole, so that a burst of load that slowed both contenders in one
    round moves both medians together, as it did in the run. The interval holds `level` of
    the resampled ratios: how far this run's own scatter could move its ratio. It does not
    see what stays constant over a run (another job running throughout), which only comparing
    runs does; the A/A control (gloo against itself) shows whether the run is calibrated: its
    interval should hold 1 in about `level` of runs.
    """
    if len(a) != len(b) or not a:
        raise ValueError(f"need two equally long, non-empty lists of times, got {len(a)} and "
                         f"{len(b)}")
    ta, tb = (torch.tensor(x, dtype=torch.float64) for x in (a, b))
    n = len(a)
    picks = torch.randint(n, (resamples, n), generator=torch.Generator().manual_seed(seed))

    def medians(t: torch.Tensor) -> torch.Tensor:  # per row, the mean of the middle two, as
        s = t[picks].sort(dim=1).values  # statistics.median (torch.quantile refuses inputs
        return (s[:, (n - 1) // 2] + s[:, n // 2]) / 2  # over 2**24 elements in some versions)

    ratios = medians(ta) / medians(tb)
    tail = (1 - level) / 2
    lo, hi = torch.quantile(ratios, torch.tensor([tail, 1 - tail], dtype=torch.float64))
    return lo.item(), hi.item()


def straggle(spent_s: float, factor: float) -> None:
    """Make work that took `spent_s` seconds look `factor` times slower, by sleeping for the
    difference: how `--straggler RANK:FACTOR` turns one rank into a straggler, so that sync
    and async training are compared on a measured slowdown rather than an argued one."""
    if factor > 1 and spent_s > 0:
        time.sleep((factor - 1) * spent_s)


def straggle_after_forward(forward_s: float, factor: float) -> None:
    """`straggle` for a rank whose backward runs inside data parallelism: its backward's own
    time would include the all-reduce (waiting on the other ranks is no computing of its
    own), so the work is counted from the forward alone, the backward as two forwards."""
    straggle(3 * forward_s, factor)
