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
        self._lock = threading.Lock()

    def add(self, span: Span) -> None:
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
    return _recorder


def enabled() -> bool:
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
