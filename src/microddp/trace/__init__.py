"""Timelines of DDP steps: the recorder's API (microddp.spans, re-exported here so
`microddp.trace.span(...)` reads as before), the report that merges the ranks' spans into one
Chrome trace and a picture (report.py), and traced runs of the engines (steps.py)."""

from ..spans import (
    Recorder,
    Span,
    add_span,
    enabled,
    intersection,
    kind,
    length,
    next_step,
    recorder,
    span,
    start,
    step_stats,
    stop,
    subtract,
    union,
    use,
)

__all__ = ["Recorder", "Span", "add_span", "enabled", "intersection", "kind", "length",
           "next_step", "recorder", "span", "start", "step_stats", "stop", "subtract", "union",
           "use"]
