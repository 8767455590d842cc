"""Per-rank traces in the PyTorch profiler's (Kineto's) JSON format, for HolisticTraceAnalysis.

HTA's TraceAnalysis reads a folder of one profiler trace per rank and answers from the device
streams only: its temporal breakdown (idle, compute, non-compute time) and its communication /
computation overlap count "kernels" (events with a stream), and it knows a communication
kernel by NCCL's naming (`nccl...Kernel`). A CPU job has no device and no kernels, so HTA would
find nothing in a CPU profiler trace. microddp's own spans say what HTA needs: each rank's
compute (forward, backward, optimizer, less the time it waits for communication) and each
communication call from launch to completion. This module writes them as two streams per rank:
compute on stream 7 and communication on stream 20, named `ncclKernel_gloo_<span>` so HTA files
them as communication (they are gloo's, on the CPU), each with the CPU-side event it correlates
with and one ProfilerStep#N annotation per step. The warm-up step is left out, as microddp's own
summary leaves it out. HTA's idle time is then the time a rank neither computes nor
communicates (data loading, Python between spans, gaps between steps).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .. import outputs
from ..spans import Span, kind, length, step_stats, subtract, union

FOLDER = "hta"
COMPUTE_STREAM, COMM_STREAM = 7, 20
PID_DEVICE = 0  # HTA's device: the rank's "GPU" in its view


def kept_steps(by_rank: dict[int, list[Span]]) -> list[int]:
    """The steps the summary averages (report.summarize): all but the first when there are 3+."""
    steps = sorted({s.step for spans in by_rank.values() for s in spans})
    return steps[1:] if len(steps) >= 3 else steps


def _us(t: float, t0: float) -> float:
    return round((t - t0) * 1e6, 3)


def rank_trace(rank: int, world_size: int, spans: list[Span], steps: list[int],
               t0: float) -> dict:
    """One rank's trace: ProfilerStep annotations, and per compute piece and communication
    call a CPU op launching a kernel on the compute or the communication stream."""
    pid_cpu = 1000 + rank
    events: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": pid_cpu, "args": {"name": f"rank {rank} CPU"}},
        {"ph": "M", "name": "process_name", "pid": PID_DEVICE,
         "args": {"name": f"rank {rank} (compute and gloo, as streams)"}},
    ]
    corr = 0

    def kernel(name: str, start: float, end: float, stream: int, step: int) -> None:
        nonlocal corr
        corr += 1
        common = {"ts": _us(start, t0), "dur": round(max(end - start, 0.0) * 1e6, 3)}
        events.append({"ph": "X", "cat": "cpu_op", "name": f"launch {name}", "pid": pid_cpu,
                       "tid": 1, **common, "args": {"correlation": corr, "step": step}})
        events.append({"ph": "X", "cat": "kernel", "name": name, "pid": PID_DEVICE,
                       "tid": stream, **common,
                       "args": {"stream": stream, "correlation": corr, "device": 0,
                                "step": step}})

    for step in steps:
        mine = [s for s in spans if s.step == step]
        if not mine:
            continue
        start, end = min(s.start for s in mine), max(s.end for s in mine)
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}",
                       "pid": pid_cpu, "tid": 1, "ts": _us(start, t0),
                       "dur": round((end - start) * 1e6, 3), "args": {}})
        waits = [(s.start, s.end) for s in mine if kind(s) == "wait"]
        for s in mine:
            k = kind(s)
            if k == "compute":  # less its waits for communication, as step_stats counts it
                for a, b in subtract([(s.start, s.end)], waits):
                    kernel(s.name, a, b, COMPUTE_STREAM, step)
            elif k == "comm":
                kernel(f"ncclKernel_gloo_{s.name}".replace(" ", "_"), s.start, s.end,
                       COMM_STREAM, step)
    return {
        "schemaVersion": 1,
        "distributedInfo": {"backend": "gloo", "rank": rank, "world_size": world_size},
        "deviceProperties": [],
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "baseTimeNanoseconds": int(t0 * 1e9),
        "otherData": {"producer": "microddp", "what": "microddp spans as Kineto streams"},
    }


def write(by_rank: dict[int, list[Span]], run_dir: str | os.PathLike) -> list[Path]:
    """Write RUN/hta/rank_N.json for every rank; the paths."""
    steps = kept_steps(by_rank)
    starts = [s.start for spans in by_rank.values() for s in spans]
    t0 = min(starts) if starts else 0.0
    folder = Path(run_dir) / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for rank, spans in sorted(by_rank.items()):
        path = folder / f"rank_{rank}.json"
        outputs.write_text(path, json.dumps(rank_trace(rank, len(by_rank), spans, steps, t0)))
        paths.append(path)
    return paths


def own_figures(by_rank: dict[int, list[Span]]) -> dict[int, dict[str, float]]:
    """microddp's own figures for what HTA reports, per rank over the steps written (µs):
    compute, exposed communication (HTA's non-compute time), the time from the first compute
    or communication to the last with neither (HTA's idle), and overlap (hidden / all
    communication, percent)."""
    steps = set(kept_steps(by_rank))
    out = {}
    for rank, spans in sorted(by_rank.items()):
        per = [step_stats([s for s in spans if s.step == k]) for k in sorted(steps)
               if any(s.step == k for s in spans)]
        comm = sum(p["comm_s"] for p in per)
        hidden = sum(p["hidden_comm_s"] for p in per)
        busy = [(a, b) for s in spans if s.step in steps and kind(s) in ("compute", "comm")
                for a, b in ([(s.start, s.end)] if kind(s) == "comm" else subtract(
                    [(s.start, s.end)], [(w.start, w.end) for w in spans
                                         if w.step == s.step and kind(w) == "wait"]))]
        merged = union(busy)
        span_s = merged[-1][1] - merged[0][0] if merged else 0.0
        out[rank] = {"compute_us": 1e6 * sum(p["compute_s"] for p in per),
                     "exposed_comm_us": 1e6 * (comm - hidden),
                     "idle_us": 1e6 * (span_s - length(merged)),
                     "overlap_pct": 100.0 * hidden / comm if comm > 0 else float("nan")}
    return out
