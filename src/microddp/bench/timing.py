"""Honest timing on a noisy machine: interleave the contenders, repeat, compare medians."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable


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
    return statistics.median(xs)


def ratio_of_medians(a: list[float], b: list[float]) -> float:
    """median(a) / median(b): below 1 means `a` is faster."""
    return statistics.median(a) / statistics.median(b)
