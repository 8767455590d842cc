"""Timeline recording: each rank notes spans (forward, backward, each bucket's all-reduce, ...).

The calls sprinkled through the library cost one global lookup when no recorder is active, so
they can stay in the hot path. `start()` turns recording on for this process; `finish()` ends it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class Span:
    """One interval on one track of one rank. Times are time.perf_counter() seconds."""

    name: str
    start: float
    end: float
    track: str = "compute"  # "compute", "comm", "data", "optim", ...
    step: int = -1
    args: dict = field(default_factory=dict)


class Recorder:
    """Collects the spans of one rank; thread-safe because comm callbacks finish off-thread."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.step = 0
        self.origin = time.perf_counter()
        # perf_counter has no shared zero across hosts: keep the wall clock at the same instant
        # so the ranks' spans can be placed on one time axis when merged.
        self.wall_origin = time.time()
        self._lock = threading.Lock()

    def add(self, span: Span) -> None:
        """Keep a finished span (thread-safe: the reducer records from autograd's thread)."""
        with self._lock:
            self.spans.append(span)


_recorder: Recorder | None = None


def start() -> Recorder:
    """Begin recording spans in this process (replacing any earlier recording)."""
    global _recorder
    _recorder = Recorder()
    return _recorder


def stop() -> Recorder | None:
    """End recording and hand back what was recorded."""
    global _recorder
    rec, _recorder = _recorder, None
    return rec


def recorder() -> Recorder | None:
    """The recorder spans go to now, or None when nothing records."""
    return _recorder


@contextmanager
def use(rec: Recorder | None) -> Iterator[Recorder | None]:
    """Record into `rec` inside the block (e.g. one recorder per contender in a benchmark)."""
    global _recorder
    before, _recorder = _recorder, rec
    try:
        yield rec
    finally:
        _recorder = before


def enabled() -> bool:
    """Whether spans are being recorded (so callers skip the clock when not)."""
    return _recorder is not None


def next_step() -> None:
    """Mark the start of a new training step (spans are grouped per step in summaries)."""
    if _recorder is not None:
        _recorder.step += 1


def add_span(name: str, start_s: float, end_s: float, track: str = "compute", **args) -> None:
    """Record an interval measured elsewhere (e.g. an async all-reduce: launch to completion)."""
    rec = _recorder
    if rec is not None:
        rec.add(Span(name, start_s, end_s, track, rec.step, args))


def add_when_done(futures: list, name: str, launched: float, track: str = "comm",
                  **args) -> None:
    """While spans are recorded: `name` on `track` from `launched` until the last of
    `futures` completes, seen by its callback rather than by a later wait (so the span ends
    when the bytes arrived, and the overlap figures count it right). The span belongs to the
    step it was launched in, even if a callback runs after the next step began."""
    rec = _recorder
    if rec is None or not futures:
        return
    step, left, lock = rec.step, [len(futures)], threading.Lock()

    def done(_fut) -> None:
        with lock:  # the callbacks of different collectives may run on different threads
            left[0] -= 1
            last = left[0] == 0
        if last:
            rec.add(Span(name, launched, time.perf_counter(), track, step, args))

    for fut in futures:
        fut.add_done_callback(done)


@contextmanager
def span(name: str, track: str = "compute", **args) -> Iterator[None]:
    """Record the time spent inside the `with` block."""
    rec = _recorder
    if rec is None:
        yield
        return
    t0 = time.perf_counter()
    try:
        yield
    finally:
        rec.add(Span(name, t0, time.perf_counter(), track, rec.step, args))


# ---- overlap figures: how much communication hid behind computation, step by step ----------

def kind(s: Span) -> str:
    """Which budget a span belongs to: compute, comm, wait (for comm), or data."""
    if s.track == "comm":
        return "comm"
    if s.track == "comm_wait" or s.name.startswith("wait"):
        return "wait"
    if s.track == "data" or s.name == "data":
        return "data"
    return "compute"


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge overlapping intervals, so nested or concurrent spans are not counted twice."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(intervals: list[tuple[float, float]]) -> float:
    """Total time covered by `intervals`, overlaps counted once."""
    return sum(b - a for a, b in union(intervals))


def subtract(xs: list[tuple[float, float]],
             ys: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of xs not covered by ys."""
    out = []
    ys = union(ys)
    for a, b in union(xs):
        for c, d in ys:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return out


def intersection(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Total time covered by both sets of intervals."""
    xs, ys = union(xs), union(ys)
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, hi - lo)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def step_stats(spans: list[Span]) -> dict[str, float]:
    """One rank's figures for one step, in seconds.

    Communication is hidden where it runs while the rank computes; the rest is exposed, the
    part that lengthens the step. overlap_pct = hidden / total communication.
    """
    by: dict[str, list[tuple[float, float]]] = {"compute": [], "comm": [], "wait": [], "data": []}
    for s in spans:
        by[kind(s)].append((s.start, s.end))
    # A wait for communication inside backward (the end-of-backward callback) is not compute.
    compute = subtract(by["compute"], by["wait"])
    comm = length(by["comm"])
    hidden = intersection(by["comm"], compute)
    busy = length(compute + by["comm"] + by["data"])
    step = max(s.end for s in spans) - min(s.start for s in spans) if spans else 0.0
    return {
        "step_s": step, "compute_s": length(compute), "comm_s": comm,
        "hidden_comm_s": hidden, "exposed_comm_s": comm - hidden,
        "wait_s": length(by["wait"]), "data_s": length(by["data"]),
        "other_s": max(0.0, step - busy),
        "overlap_pct": 100.0 * hidden / comm if comm > 0 else float("nan"),
    }
