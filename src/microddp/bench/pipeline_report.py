"""What `microddp bench pipeline` makes of the ranks' records: the measured timelines and their
bubbles, the table, pipeline.json, a timeline PNG per schedule and the merged Chrome trace."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from .. import outputs, pipeline
from ..pipeline import Action, Timeline
from ..spans import Span
from ..timing import compare
from ..trace import report as trace_report


def measured_timeline(ranks_spans: list[list[tuple]], p: int) -> Timeline:
    """One step's recorded spans (per rank: (kind, stage, mb, start, end)) as a Timeline whose
    clock starts at the step's first compute: its `bubble` is the idle share of the ranks'
    time from the first compute to the last, as `pipeline.simulate`'s is on paper."""
    t0 = min(s for spans in ranks_spans for _, _, _, s, _ in spans)
    end = max(e for spans in ranks_spans for _, _, _, _, e in spans)
    return Timeline([[(s - t0, e - t0, Action(r, kind, mb, stage, stage // p))
                      for kind, stage, mb, s, e in spans]
                     for r, spans in enumerate(ranks_spans)], end - t0)


def summarize(cfg: dict, ranks: list[dict], load: tuple[float, float, float]) -> dict:
    """pipeline.json's content: per schedule its bubbles, peaks and step time; the config; and
    the ratios against torch's schedules."""
    p, m = cfg["stages"], cfg["microbatches"]
    times = ranks[0]["times"]  # already the slowest rank's, step by step
    result: dict = {"config": {**{k: v for k, v in cfg.items() if k != "torch"},
                               "backend": "gloo", "load_average": [round(x, 2) for x in load]}}
    for name in cfg["schedules"]:
        schedule = pipeline.build(name, p, m, cfg["virtual"])
        steps = len(ranks[0]["log"][name])
        timelines = [measured_timeline([r["log"][name][k] for r in ranks], p)
                     for k in range(steps)]
        bubbles = [t.bubble for t in timelines]
        median_step = sorted(range(steps), key=lambda k: bubbles[k])[steps // 2]
        result[name] = {
            "bubble_measured": round(statistics.median(bubbles), 4),
            "bubble_theory": round(pipeline.theory_bubble(schedule), 4),
            "bubble_on_paper": round(pipeline.simulate(schedule).bubble, 4),
            "peak_activation_bytes": [r["peak"][name][0] for r in ranks],
            "peak_saved_bytes": [r["peak"][name][1] for r in ranks],
            "step_ms": round(1e3 * statistics.median(times[name]), 3),
            "timed_steps": steps,
            "drawn_step": median_step,
        }
    versus = {}
    for name in cfg["torch"]:
        versus[name] = {"torch_ms": round(1e3 * statistics.median(times[f"torch-{name}"]), 3)}
        if name in times:  # zbv runs as the classes only
            ratio, (lo, hi) = compare(times[name], times[f"torch-{name}"])
            versus[name].update(microddp_ms=round(1e3 * statistics.median(times[name]), 3),
                                ratio=round(ratio, 4), interval_90=[round(lo, 4), round(hi, 4)])
        if f"shaped-{name}" in times:  # microddp's torch-shaped class of the same name
            ratio, (lo, hi) = compare(times[f"shaped-{name}"], times[f"torch-{name}"])
            versus[name].update(
                shaped_ms=round(1e3 * statistics.median(times[f"shaped-{name}"]), 3),
                shaped_ratio=round(ratio, 4), shaped_interval_90=[round(lo, 4), round(hi, 4)])
    result["versus_torch"] = versus
    return result


def _kib(n: int) -> str:
    return f"{n / 1024:.0f}"


def table(result: dict) -> str:
    """The printed table: bubble measured and in theory, step time and peak activations per schedule."""
    cfg = result["config"]
    mode = ("sleep: each block sleeps "
            f"{cfg['sleep_ms']:g} ms forward, {2 * cfg['sleep_ms']:g} ms backward, on top of its "
            "compute" if cfg["compute"] == "sleep" else "real: the model's own compute")
    la = ", ".join(f"{x:.2f}" for x in cfg["load_average"])
    lines = [f"pipeline: {cfg['stages']} ranks, {cfg['microbatches']} micro-batches, "
             f"FullMLP({cfg['dim']}, depth {cfg['depth']}), batch {cfg['batch']}, gloo; "
             f"median of {cfg['repeats']} interleaved steps; load average {la}",
             f"compute mode: {mode}; ranks "
             + ("pinned, rank r to core r mod cores" if cfg.get("pinned") else "unpinned"),
             f"{'schedule':12}{'bubble':>8}{'theory':>8}{'paper':>7}{'step ms':>10}  "
             "peak activations per rank, KiB: held (of it saved by autograd)"]
    for name in cfg["schedules"]:
        r = result[name]
        lines.append(f"{name:12}{r['bubble_measured']:>8.3f}{r['bubble_theory']:>8.3f}"
                     f"{r['bubble_on_paper']:>7.3f}{r['step_ms']:>10.2f}  "
                     + " ".join(f"{_kib(held)} ({_kib(saved)})" for held, saved in
                                zip(r["peak_activation_bytes"], r["peak_saved_bytes"],
                                    strict=True)))
    lines.append("bubble: idle share of the ranks' time, measured from the recorded timeline; "
                 "theory: the schedule's formula; paper: its plan played with F = 1, B = 2, "
                 "I = W = 1; held: saved activations and message buffers (posted receives, "
                 "sends in flight)")
    if result["versus_torch"]:
        lines.append("against torch.distributed.pipelining (same split, interleaved steps, "
                     "ratio of medians, 90% bootstrap interval):")
        for name, v in result["versus_torch"].items():
            if "ratio" in v:
                lo, hi = v["interval_90"]
                lines.append(f"  {name:12} microddp {v['microddp_ms']:8.2f} ms  torch "
                             f"{v['torch_ms']:8.2f} ms  {v['ratio']:.3f}x ({lo:.3f}-{hi:.3f})")
            else:
                lines.append(f"  {name:12} {'':17} torch {v['torch_ms']:8.2f} ms")
            if "shaped_ms" in v:
                lo, hi = v["shaped_interval_90"]
                lines.append(f"  {'':12} its torch-shaped class {v['shaped_ms']:8.2f} ms  "
                             f"{v['shaped_ratio']:.3f}x of torch's ({lo:.3f}-{hi:.3f})")
    return "\n".join(lines)


COLORS = {"F": "tab:blue", "B": "tab:orange", "I": "tab:red", "W": "tab:green"}


def plot(timeline: Timeline, title: str, path: Path) -> None:
    """One step's measured timeline: a row per rank, a bar per compute action."""
    import matplotlib  # noqa: PLC0415 (heavy, and only needed here)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    p = len(timeline.spans)
    fig, ax = plt.subplots(figsize=(11, 1 + 0.6 * p))
    seen = set()
    for r, spans in enumerate(timeline.spans):
        for start, end, a in spans:
            ax.broken_barh([(1e3 * start, 1e3 * (end - start))], (r - 0.4, 0.8),
                           facecolors=COLORS[a.kind], edgecolor="black", linewidth=0.3,
                           label=None if a.kind in seen else a.kind)
            seen.add(a.kind)
            if end - start > 0.03 * timeline.makespan:
                ax.text(1e3 * (start + end) / 2, r, str(a.mb), ha="center", va="center",
                        fontsize=7)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's first compute")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    fig.tight_layout()
    with outputs.atomic(path) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)


def chrome_spans(ranks: list[dict], schedules: list[str]) -> dict[int, list[Span]]:
    """Every timed step of every schedule, per rank, on the wall clock (perf_counter is one
    clock for a host's processes; its offset to time.time() is taken here, once)."""
    shift = time.time() - time.perf_counter()
    out: dict[int, list[Span]] = {}
    for r, rank in enumerate(ranks):
        out[r] = [Span(f"{name} {kind}{mb}", s + shift, e + shift, "compute", k,
                       {"schedule": name, "stage": stage, "micro_batch": mb})
                  for name in schedules
                  for k, spans in enumerate(rank["log"][name])
                  for kind, stage, mb, s, e in spans]
    return out


def write(result: dict, ranks: list[dict], out: Path) -> list[Path]:
    """pipeline.json, timeline-NAME.png for each schedule (its median-bubble step), trace.json."""
    cfg, files = result["config"], []
    for name in cfg["schedules"]:
        r = result[name]
        k = r["drawn_step"]
        timeline = measured_timeline([rank["log"][name][k] for rank in ranks],
                                     cfg["stages"])
        path = out / f"timeline-{name}.png"
        plot(timeline, f"{name}, p={cfg['stages']}, m={cfg['microbatches']}, compute "
             f"{cfg['compute']}: bubble {timeline.bubble:.3f} (theory {r['bubble_theory']:.3f})",
             path)
        r["timeline_png"] = path.name
        files.append(path)
    outputs.write_text(out / "trace.json",
                       json.dumps(trace_report.chrome_trace(chrome_spans(ranks, cfg["schedules"]))))
    files.append(out / "trace.json")
    outputs.write_text(out / "pipeline.json", json.dumps(result, indent=1) + "\n")
    return [out / "pipeline.json", *files]
