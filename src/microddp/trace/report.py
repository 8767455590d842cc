"""Merge every rank's spans into one picture: Chrome-trace JSON, a PNG timeline, per-step figures.

`finish(run_dir, world)` is what a traced job calls at its end, on every rank: the spans travel
to rank 0, which writes trace.json (open it in https://ui.perfetto.dev or chrome://tracing) and
timeline.png; every rank gets back the same summary of compute, communication and overlap.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path
from typing import Any

from .. import outputs
from ..errors import MicroDDPError
from ..spans import Recorder, Span, kind, step_stats
from ..spans import stop as stop_recording
from ..transport.objects import broadcast_value, gather_values
from ..world.world import World, distributed, get_world
from . import kineto

TID_MAIN, TID_COMM = 0, 1
FIELDS = ("step_s", "compute_s", "comm_s", "hidden_comm_s", "exposed_comm_s", "wait_s",
          "data_s", "other_s", "overlap_pct")


def to_wall(rec: Recorder) -> list[Span]:
    """This rank's spans on the wall clock, the one axis that all ranks (and hosts) share."""
    shift = rec.wall_origin - rec.origin
    with rec._lock:
        spans = list(rec.spans)
    return [Span(s.name, s.start + shift, s.end + shift, s.track, s.step, dict(s.args))
            for s in spans]


def gather(rec: Recorder | None, world: World | None = None) -> dict[int, list[Span]] | None:
    """Every rank's spans, on rank 0 (None elsewhere). Every rank must call it."""
    world = world or get_world()
    mine = to_wall(rec) if rec is not None else []
    if not distributed():
        return {0: mine}
    rows = [[s.name, s.start, s.end, s.track, s.step, {k: _jsonable(v) for k, v in s.args.items()}]
            for s in mine]
    out = gather_values(rows, dst=0)  # JSON, never pickle: see transport/objects.py
    return {r: [Span(*row) for row in spans] for r, spans in enumerate(out)} \
        if out is not None else None


def _jsonable(v: Any) -> Any:
    return v if isinstance(v, (int, float, str, bool)) or v is None else str(v)


def chrome_trace(by_rank: dict[int, list[Span]]) -> dict:
    """Chrome-trace events: per rank a main track and a communication track, times in µs.

    One link carries one all-reduce at a time, so on the communication track each bucket is
    drawn from when the link is free for it to when it completes; its launch time is kept in
    args (launch_us) and is what the figures use.
    """
    starts = [s.start for mine in by_rank.values() for s in mine]
    t0 = min(starts) if starts else 0.0
    events: list[dict] = []
    for rank, mine in sorted(by_rank.items()):
        events += [
            {"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}},
            {"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}},
            {"ph": "M", "name": "thread_name", "pid": rank, "tid": TID_MAIN,
             "args": {"name": "compute"}},
            {"ph": "M", "name": "thread_name", "pid": rank, "tid": TID_COMM,
             "args": {"name": "communication"}},
        ]
        link_free = -math.inf
        for s in sorted(mine, key=lambda s: (s.start, -s.end)):
            start, tid = s.start, TID_MAIN
            args = {k: _jsonable(v) for k, v in s.args.items()}
            args.update(step=s.step, track=s.track)
            if s.track == "comm":
                tid, start = TID_COMM, max(s.start, link_free)
                link_free = max(link_free, s.end)
                args["launch_us"] = round((s.start - t0) * 1e6, 3)
            events.append({"name": s.name, "cat": s.track, "ph": "X", "pid": rank, "tid": tid,
                           "ts": round((start - t0) * 1e6, 3),
                           "dur": round(max(0.0, s.end - start) * 1e6, 3), "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"producer": "microddp", "wall_origin_s": t0}}


def spans_from_chrome(doc: dict) -> dict[int, list[Span]]:
    """Read spans back from a trace written by `chrome_trace` (launch times restored)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise MicroDDPError("not a Chrome trace: expected a JSON object with 'traceEvents'")
    out: dict[int, list[Span]] = {}
    for e in doc["traceEvents"]:
        if e.get("ph") != "X":
            continue
        args = dict(e.get("args", {}))
        step, track = args.pop("step", -1), args.pop("track", e.get("cat", "compute"))
        end = (e["ts"] + e["dur"]) / 1e6
        start = args.pop("launch_us", e["ts"]) / 1e6
        out.setdefault(int(e["pid"]), []).append(Span(e["name"], start, end, track, step, args))
    return out


def load(path: str | os.PathLike) -> dict[int, list[Span]]:
    """Spans from a trace.json on disk."""
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise MicroDDPError(f"no trace at {path}; run `microddp trace` or train with --trace "
                            "to make one") from None
    except json.JSONDecodeError as e:
        raise MicroDDPError(f"{path} is not valid JSON ({e}); was the run cut short?") from None
    return spans_from_chrome(doc)


def per_step(by_rank: dict[int, list[Span]]) -> list[dict]:
    """Figures per step, averaged over ranks (seconds; overlap in percent)."""
    steps = sorted({s.step for spans in by_rank.values() for s in spans})
    rows = []
    for step in steps:
        stats = [step_stats([s for s in spans if s.step == step])
                 for spans in by_rank.values() if any(s.step == step for s in spans)]
        row: dict[str, float] = {"step": step}
        for f in FIELDS:
            vals = [st[f] for st in stats if not math.isnan(st[f])]
            row[f] = statistics.fmean(vals) if vals else float("nan")
        rows.append(row)
    return rows


def summarize(rows: list[dict]) -> dict:
    """Mean of each figure over the steps, leaving out the first (warm-up) when there are 3+.

    Means, not medians, so that compute + exposed comm + data + other adds up to the step.
    """
    kept = rows[1:] if len(rows) >= 3 else rows
    out: dict[str, float] = {"steps": len(rows), "steps_summarized": len(kept)}
    for f in FIELDS:
        vals = [r[f] for r in kept if not math.isnan(r[f])]
        out[f] = statistics.fmean(vals) if vals else float("nan")
    # of the total, not a mean of per-step percentages: a short step must not weigh as much
    comm = out["comm_s"]
    out["overlap_pct"] = 100.0 * out["hidden_comm_s"] / comm if comm > 0 else float("nan")
    return out


def format_summary(summary: dict) -> str:
    """The run summary's trace lines, from `finish`'s (or `write`'s) result."""
    def ms(key: str) -> str:
        return f"{summary[key]:.2f} ms"

    ov = summary["overlap_pct"]
    ov = float("nan") if ov is None else ov
    return "\n".join([
        f"trace: mean over {summary['steps_summarized']} of {summary['steps']} steps",
        f"  step {ms('step_ms')} = compute {ms('compute_ms')} + exposed comm "
        f"{ms('exposed_comm_ms')} + data {ms('data_ms')} + other {ms('other_ms')}",
        f"  communication {ms('comm_ms')}: hidden {ms('hidden_comm_ms')}, exposed "
        f"{ms('exposed_comm_ms')}, overlap {'n/a' if math.isnan(ov) else f'{ov:.0f}%'}",
    ])


def plot_timeline(by_rank: dict[int, list[Span]], path: str | os.PathLike,
                  steps: int = 3) -> list[int]:
    """A PNG of a few steps (the last `steps`, skipping warm-up); returns the steps drawn."""
    import matplotlib  # noqa: PLC0415 (heavy, and only needed here)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    all_steps = sorted({s.step for spans in by_rank.values() for s in spans})
    shown = all_steps[-steps:]
    spans = {r: [s for s in ss if s.step in shown] for r, ss in by_rank.items()}
    starts = [s.start for ss in spans.values() for s in ss]
    t0 = min(starts) if starts else 0.0
    colors = {"forward": "tab:blue", "backward": "tab:orange", "optimizer": "tab:green",
              "data": "tab:gray", "wait": "tab:red", "comm": "tab:purple"}
    fig, ax = plt.subplots(figsize=(11, 1 + 0.9 * len(spans)))
    labels, seen = [], set()
    for row, (rank, ss) in enumerate(sorted(spans.items())):
        for lane, is_comm in ((0, False), (1, True)):
            y = 2 * row + lane
            labels.append(f"rank {rank} {'comm' if is_comm else 'compute'}")
            for s in sorted(ss, key=lambda s: s.start - s.end):  # longest first: nested on top
                if (kind(s) == "comm") != is_comm:
                    continue
                key = kind(s) if kind(s) in ("comm", "wait", "data") else s.name
                color = colors.get(key, "tab:olive")
                ax.broken_barh([((s.start - t0) * 1e3, (s.end - s.start) * 1e3)], (y - 0.4, 0.8),
                               facecolors=color, edgecolor="black", linewidth=0.3,
                               alpha=0.6 if is_comm else 0.9,
                               label=None if key in seen else key)
                seen.add(key)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(f"microddp timeline, steps {shown[0]}..{shown[-1]}" if shown else "no spans")
    if seen:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    fig.tight_layout()
    with outputs.atomic(path) as tmp:  # a reader never sees half a PNG
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
    return shown


def in_ms(row: dict) -> dict:
    """Seconds -> milliseconds, rounded for people; key names say the unit."""
    out = {}
    for k, v in row.items():
        if isinstance(v, float) and math.isnan(v):
            v = None  # JSON has no NaN: no communication means no overlap figure
        if k.endswith("_s"):
            k, v = k[:-2] + "_ms", None if v is None else round(1e3 * v, 3)
        elif k == "overlap_pct" and v is not None:
            v = round(v, 1)
        out[k] = v
    return out


def _is_trace_row(line: str) -> bool:
    try:
        return json.loads(line).get("kind") == "trace_step"
    except (ValueError, AttributeError):  # not ours to judge: keep it
        return False


def _replace_trace_rows(path: Path, rows: list[dict]) -> None:
    """This run's trace_step rows replace an earlier run's, as trace.json is replaced: rows of
    two runs never mix. Other rows (a training job's steps and epochs) stay, in order."""
    kept = [line for line in (path.read_text().splitlines() if path.exists() else [])
            if line.strip() and not _is_trace_row(line)]
    new = [json.dumps({"kind": "trace_step", **in_ms(row)}) for row in rows]
    outputs.write_text(path, "".join(line + "\n" for line in kept + new))


def write(by_rank: dict[int, list[Span]], run_dir: str | os.PathLike,
          metrics: bool = True) -> dict:
    """Write trace.json, timeline.png, hta/ (one profiler-format trace per rank: kineto.py)
    and this run's per-step rows in metrics.jsonl (in place of an earlier trace's); return the
    summary.

    The summary is flat: medians in ms, overlap_pct, the number of steps and the paths.
    """
    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    outputs.write_text(out / "trace.json", json.dumps(chrome_trace(by_rank)))
    kineto.write(by_rank, out)  # per-rank profiler-format traces for HTA, beside it
    plot_timeline(by_rank, out / "timeline.png")
    rows = per_step(by_rank)
    if metrics:
        _replace_trace_rows(out / "metrics.jsonl", rows)
    return {**in_ms(summarize(rows)), "trace_json": str(out / "trace.json"),
            "timeline_png": str(out / "timeline.png"), "hta_dir": str(out / kineto.FOLDER)}


def finish(run_dir: str | os.PathLike, world: World | None = None) -> dict:
    """End this rank's recording; rank 0 writes trace.json, timeline.png and per-step rows
    (kind "trace_step", replacing an earlier trace's) in metrics.jsonl; every rank gets back
    the same summary.

    Every rank must call it (it gathers the spans).
    """
    world = world or get_world()
    rec = stop_recording()
    if rec is None:
        raise MicroDDPError("tracing was never started on this rank; call microddp.spans.start() "
                            "before the first step")
    by_rank = gather(rec, world)
    result = write(by_rank, run_dir) if by_rank is not None else None
    return broadcast_value(result, src=0) if distributed() else result
