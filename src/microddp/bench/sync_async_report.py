"""What `microddp bench async` prints and writes: the table (medians over rounds, ratio to sync
dp), async.json with every run, async.png with test accuracy against wall-clock time and the
staleness histograms."""

from __future__ import annotations

import json
import math
import os
import statistics
from collections import Counter
from pathlib import Path

from .. import outputs


def _reached(curve: list, target: float) -> float | None:
    """Seconds until the first kept copy at or above `target` accuracy, or None."""
    return next((t for t, _, acc in curve if acc >= target), None)


def _order(name: str) -> float:
    """sync dp, ps S=0, its backup run, SSP by bound, async: from most to least synchronous."""
    if name.startswith("ps SSP S="):
        return 3 + float(name.removeprefix("ps SSP S=")) / 1e6
    return {"sync dp": 0, "sync dp (A/A)": 0.5, "ps S=0": 1, "ps async": 9}.get(name, 2)


def summarize(runs: list[dict], target: float) -> list[dict]:
    """One row per (configuration, straggler): medians over rounds, staleness over all."""
    rows = []
    keys = sorted(dict.fromkeys((r["setup"], r["straggler"]) for r in runs),
                  key=lambda k: _order(k[0]))
    for straggling in (False, True):
        base = [r["samples"] / r["seconds"] for r in runs
                if r["setup"] == "sync dp" and r["straggler"] == straggling]
        for name, st in (k for k in keys if k[1] == straggling):
            mine = [r for r in runs if (r["setup"], r["straggler"]) == (name, st)]
            rates = [r["samples"] / r["seconds"] for r in mine]
            # per round, this run's rate over sync dp's in the same round: their spread
            per_round = {r["round"]: r["samples"] / r["seconds"] for r in runs
                         if r["setup"] == "sync dp" and r["straggler"] == straggling}
            ratios = sorted(r["samples"] / r["seconds"] / per_round[r["round"]] for r in mine
                            if r["round"] in per_round)
            hist: Counter = Counter()
            for r in mine:
                hist.update({int(k): v for k, v in r["histogram"].items()})
            applied = sum(hist.values())
            reach = [_reached(r["curve"], target) for r in mine]
            rows.append({
                "setup": name, "straggler": st, "rounds": len(mine),
                "samples_per_s": statistics.median(rates),
                "vs_sync_dp": statistics.median(rates) / statistics.median(base) if base else None,
                "ratio_range": [ratios[0], ratios[-1]] if ratios else None,
                "updates": statistics.median(r["updates"] for r in mine),
                "test_accuracy": statistics.median(r["curve"][-1][2] for r in mine),
                "seconds_to_target": (statistics.median(x for x in reach if x is not None)
                                      if all(x is not None for x in reach) else None),
                "mean_staleness": (sum(k * v for k, v in hist.items()) / applied
                                   if applied else 0.0),
                "max_staleness": max(hist) if applied else 0,
                "histogram": dict(sorted(hist.items())),
                "discarded": sum(r["discarded"] for r in mine)})
    return rows


def table(rows: list[dict], factor: float, target: float) -> str:
    """The printed table: one row per configuration and straggler setting."""
    head = (f"{'configuration':<20} {'straggler':<9} {'samples/s':>9} {'vs dp':>6} "
            f"{'rounds':>11} {'updates':>7} {'test acc':>8} {f's to {target:.0%}':>8} {'staleness':>9} "
            f"{'max':>4}")
    lines = [head, "-" * len(head)]
    for r in rows:
        reach = "never" if r["seconds_to_target"] is None else f"{r['seconds_to_target']:.2f}"
        lo, hi = r.get("ratio_range") or (math.nan, math.nan)
        lines.append(f"{r['setup']:<20} {f'x{factor:g}' if r['straggler'] else 'none':<9} "
                     f"{r['samples_per_s']:>9.0f} {r['vs_sync_dp']:>6.2f} {f'{lo:.2f}-{hi:.2f}':>11} "
                     f"{r['updates']:>7.0f} "
                     f"{r['test_accuracy']:>8.3f} {reach:>8} {r['mean_staleness']:>9.2f} "
                     f"{r['max_staleness']:>4}")
    return "\n".join(lines)


def plot(runs: list[dict], rows: list[dict], factor: float, path: Path) -> Path | None:
    """Accuracy against time without and with the straggler (every round, one color per
    configuration), and the straggler runs' staleness histograms."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = sorted(dict.fromkeys(r["setup"] for r in runs), key=_order)
    colors = {n: f"C{i}" for i, n in enumerate(names)}
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for ax, straggling in zip(axes[:2], (False, True), strict=True):
        labelled = set()
        for r in sorted((r for r in runs if r["straggler"] == straggling),
                        key=lambda r: _order(r["setup"])):
            t, _, acc = zip(*r["curve"], strict=True)
            ax.plot(t, [100 * a for a in acc], color=colors[r["setup"]], alpha=0.7, marker=".",
                    label=None if r["setup"] in labelled else r["setup"])
            labelled.add(r["setup"])
        ax.set(xlabel="wall-clock time (s)", ylabel="test accuracy (%)", ylim=(0, 100),
               title=f"one worker x{factor:g} slower" if straggling else "no straggler")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small", loc="lower right")
    ax = axes[2]
    shown = [r for r in rows if r["straggler"] and r["max_staleness"] > 0]
    width = 0.8 / max(len(shown), 1)
    for i, r in enumerate(shown):
        total = sum(r["histogram"].values())
        xs = [k + (i - (len(shown) - 1) / 2) * width for k in r["histogram"]]
        ax.bar(xs, [100 * v / total for v in r["histogram"].values()], width=width,
               color=colors[r["setup"]], label=r["setup"])
    ax.set(xlabel="staleness (updates between pull and apply)",
           ylabel="% of applied gradients", title=f"staleness, one worker x{factor:g} slower")
    ax.grid(True, alpha=0.3)
    if shown:
        ax.legend(fontsize="small")
    fig.tight_layout()
    with outputs.atomic(path) as tmp:  # a reader never sees half a PNG
        fig.savefig(tmp, dpi=100)
    plt.close(fig)
    return path


def report(runs: list[dict], settings: dict, out: Path, load_before: tuple) -> int:
    """Print the table, write async.json and async.png into `out`; the exit code."""
    rows = summarize(runs, settings["target"])
    load = os.getloadavg()
    print(table(rows, settings["factor"], settings["target"]))
    print(f"vs dp: ratio of medians over {settings['rounds']} round(s); rounds: the range "
          "of the per-round ratios (sync dp (A/A) is sync dp against itself: the noise floor)")
    print(f"medians over {settings['rounds']} round(s); load average {load_before[0]:.2f} "
          f"before, {load[0]:.2f} after (1 min), on {os.cpu_count()} cores")
    doc = {"settings": {k: v for k, v in settings.items() if k != "deadline"},
           "load_average": {"before": load_before, "after": load},
           "cores": os.cpu_count(), "summary": rows, "runs": runs}
    outputs.write_text(out / "async.json", json.dumps(doc, indent=1))
    png = plot(runs, rows, settings["factor"], out / "async.png")
    if png is None:
        print("no async.png: matplotlib is not installed (pip install 'microddp[train]')")
    print(outputs.wrote([out / "async.json", png]))
    return 0
