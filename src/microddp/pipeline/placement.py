"""Pin a pipeline rank's process to one core: rank r on the r-th core it may use (mod their count).

Why: a pipeline rank blocks in a receive, and the send that ends its wait wakes it. Unpinned,
the woken rank ran on the sender's core while the sender, still inside its `isend`, waited on
that core's run queue (our reading: sockets wake their reader as a *synchronous* wake-up, the
writer being expected to sleep next, so Linux places the wakee on the waker's core; not traced
in the kernel, but pinning removes the delay; chapter 8 has the measurements). Pinned, each
rank's threads stay on its own core, so a wake-up never takes the sender's. With more ranks
than cores the ranks sharing a core are fixed
(r, r + cores, ...), so how they time-share is known in advance (`microddp predict` uses it).

`microddp bench pipeline` and `microddp predict --calibrate` pin their ranks; torch's
schedules in the benchmark run in the same pinned processes, so both are measured alike.
"""

from __future__ import annotations

import os


def cores() -> list[int]:
    """The cores this process may run on, in order (every core where the OS cannot say)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this OS (macOS)
        return list(range(os.cpu_count() or 1))


def core_of(rank: int, allowed: list[int] | None = None) -> int:
    """The core rank `rank` is pinned to: the (rank mod count)-th of the allowed cores."""
    allowed = cores() if allowed is None else allowed
    return allowed[rank % len(allowed)]


def pin(rank: int) -> int | None:
    """Pin every thread of this process (gloo's included, started before) and the threads it
    starts later (they inherit it) to `core_of(rank)`; returns that core, or None where the
    OS offers no pinning (macOS): the ranks then run where the OS puts them."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    core = core_of(rank)
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: this thread, and the ones it starts from now on
        threads = [0]
    for tid in threads:
        try:
            os.sched_setaffinity(tid, {core})
        except (ProcessLookupError, PermissionError):
            pass  # a thread that has just ended, or one we may not move: nothing to pin
    return core
