"""Regenerate the figures of the docs with microddp's own code: one command for all of them.

    python docs/figures/make.py                 # every figure (a few minutes on 2 cores)
    python docs/figures/make.py timeline curves # only these
    python docs/figures/make.py --out /tmp/f ladder   # a trial: docs/figures left alone

Each figure is what a `microddp` command (or microddp's own pipeline simulator) draws, run
here with small settings, copied into docs/figures/NAME.png and shrunk to a palette PNG.
figures.json keeps, per figure, the exact command, the machine and its load average; the docs
build (docs/hooks/site.py) writes that line under every figure, so a caption cannot claim a
run that did not happen. Run it from the repository root with microddp installed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MANIFEST = HERE / "figures.json"
MAX_BYTES = 150_000

# name -> (microddp arguments; the PNG the command writes into --out). Small settings, so
# every figure regenerates in a minute or two on a laptop.
COMMANDS = {
    "timeline": (["trace", "-n", "2", "--steps", "5"], "timeline.png"),
    "allreduce": (["bench", "allreduce", "-n", "2", "--sizes", "16K,64K,256K,1M,4M,16M",
                   "--repeats", "15", "--min-repeats", "7"], "allreduce_2ranks.png"),
    "scaling": (["bench", "scaling", "--ranks", "1", "2", "4", "--repeats", "12",
                 "--rounds", "2"], "scaling.png"),
    "curves": (["train", "--nproc", "2"], "curves.png"),
    # memory is counted, not timed, so a small model and few steps draw the same bars
    "zero": (["bench", "zero", "--ranks", "2", "4", "--dim", "256", "--depth", "4",
              "--repeats", "5"], "zero.png"),
    "async": (["bench", "async", "--steps", "100", "--rounds", "2"], "async.png"),
}
# drawn from microddp's runs or algorithms by a module beside this one: name -> (module,
# function(target, save)); draw_collectives.py (chapters 3, 4, 9), draw_dp.py (5, 5b),
# draw_parallel.py (11, 12), draw_mesh.py (13), draw_cp.py (14)
DRAWN_BY = {"collectives": ("draw_collectives", "draw_collectives"),
            "ring": ("draw_collectives", "draw_ring"),
            "zero-bytes": ("draw_collectives", "draw_zero_bytes"),
            "ladder": ("draw_dp", "draw_ladder"),
            "ddp-buckets": ("draw_dp", "draw_ddp_buckets"),
            "hierarchy": ("draw_parallel", "draw_hierarchy"),
            "tp-split": ("draw_parallel", "draw_tp_split"),
            "cp-memory": ("draw_cp", "draw_cp_memory"),
            "mesh": ("draw_mesh", "draw_mesh")}
# drawn here from microddp's data, then by the modules above
DRAWN = ("pipeline", "notebook", *DRAWN_BY)
NOTEBOOK = HERE.parent / "04b-ring-vs-gloo-notebook.md"


def machine() -> str:
    """The machine a figure came from, as its caption says it."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return (f"{os.cpu_count()} cores ({cpu}), {platform.system()}, Python "
            f"{platform.python_version()}, torch {torch.__version__}")


def run_command(name: str, out: Path, dest: Path = HERE) -> str:
    """Run the figure's microddp command into `out`, its PNG into `dest`; the command line as
    a user types it."""
    args, png = COMMANDS[name]
    cmd = [sys.executable, "-m", "microddp", *args, "--out", str(out)]
    done = subprocess.run(cmd, check=True, timeout=1800, stdout=subprocess.PIPE, text=True)
    (out / "stdout.txt").write_text(done.stdout)  # the table, when --keep keeps it
    shrink(out / png, dest / f"{name}.png")
    return shlex.join(["microddp", *args])


def draw_pipeline(target: Path) -> str:
    """The four schedules of chapter 8 on 4 ranks and 8 micro-batches, as microddp's simulator
    plays them (F = 1, B = 2, I = W = 1 time units): the rank x time grid, with its bubble."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from microddp import pipeline

    colors = {"F": "tab:blue", "B": "tab:orange", "I": "tab:red", "W": "tab:green"}
    names = list(pipeline.BUILDERS)
    fig, axes = plt.subplots(len(names), 1, figsize=(9, 1.35 * len(names) + 0.6), sharex=True)
    for ax, name in zip(axes, names, strict=True):
        schedule = pipeline.build(name, 4, 8)
        timeline = pipeline.simulate(schedule)
        for rank, spans in enumerate(timeline.spans):
            for start, end, action in spans:
                light = action.virtual % 2 == 1  # interleaving: a rank's second stage paler
                ax.broken_barh([(start, end - start)], (rank - 0.4, 0.8),
                               facecolors=colors[action.kind], alpha=0.55 if light else 1.0,
                               edgecolor="white", linewidth=0.5)
                ax.text((start + end) / 2, rank, str(action.mb), ha="center", va="center",
                        fontsize=6, color="white")
        ax.set_yticks(range(schedule.ranks), [f"rank {r}" for r in range(schedule.ranks)],
                      fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{name}: bubble {timeline.bubble:.0%} of the ranks' time", fontsize=9,
                     loc="left")
    axes[-1].set_xlabel("time (forward = 1 unit); numbers are micro-batches")
    handles = [matplotlib.patches.Patch(color=c, label=k) for k, c in colors.items()]
    fig.legend(handles=handles, loc="upper right", ncol=4, fontsize=7,
               title="F forward, B backward, I/W input/weight gradient", title_fontsize=7)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    save_figure(fig, target)
    return "python docs/figures/make.py pipeline (microddp.pipeline.build + simulate, p=4, m=8)"


def notebook_series() -> dict[str, dict[str, dict[float, float]]]:
    """From the lab notebook's own tables: per rank count and per section (one change to the
    ring), the median over the section's runs at each size in MiB. A table counts when its
    first header cell is exactly "2 ranks" or "4 ranks"; other columns than sizes are skipped."""
    import re
    import statistics

    series: dict[str, dict[str, dict[float, list[float]]]] = {"2 ranks": {}, "4 ranks": {}}
    section, header = "", None
    for line in NOTEBOOK.read_text().splitlines():
        if line.startswith("## "):
            section, header = line[3:].strip(), None
            continue
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif header[0] in series and not set(cells[0]) <= set("-"):
            for title, cell in zip(header[1:], cells[1:], strict=True):
                size = re.fullmatch(r"(\d+) MiB", title)
                if size and cell:
                    sizes = series[header[0]].setdefault(section, {})
                    sizes.setdefault(float(size[1]), []).append(float(cell))
    return {ranks: {sec: {mib: statistics.median(v) for mib, v in sizes.items()}
                    for sec, sizes in by.items()} for ranks, by in series.items()}


def draw_notebook(target: Path) -> str:
    """The lab notebook at a glance: after each change, the ring's time over gloo's per size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = notebook_series()
    fig, axes = plt.subplots(1, 2, figsize=(11, 6.2), sharey=True,
                             gridspec_kw={"width_ratios": [1.6, 1]})
    for ax, (ranks, sections) in zip(axes, series.items(), strict=True):
        cmap = plt.get_cmap("viridis_r")
        for i, (section, points) in enumerate(sections.items()):
            sizes = sorted(points)
            ax.plot(sizes, [points[s] for s in sizes], "o-", ms=3, lw=1.3,
                    color=cmap(0.15 + 0.85 * i / max(len(sections) - 1, 1)),
                    label=section if len(section) < 44 else section[:41] + "...")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.axhline(1.11, color="tab:red", lw=0.8, ls="--")
        ax.text(0.02, 1.113, "target: 0.9x gloo's speed", color="tab:red", fontsize=7,
                transform=ax.get_yaxis_transform())
        ticks = sorted({s for points in sections.values() for s in points})
        ax.set(xscale="log", title=f"{ranks}: median over each section's runs",
               xlabel="all-reduce size (MiB)")
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2,
                  frameon=False, title="oldest (pale) to newest (dark)", title_fontsize=7)
    axes[0].set_ylabel("ring time / gloo time (lower is faster)")
    fig.tight_layout()
    save_figure(fig, target)
    return "python docs/figures/make.py notebook (the tables of this page)"


def draw(name: str, target: Path) -> str:
    """Draw one figure of DRAWN into `target`; the command its caption shows."""
    if name == "pipeline":
        return draw_pipeline(target)
    if name == "notebook":
        return draw_notebook(target)
    import importlib

    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    module, function = DRAWN_BY[name]
    return getattr(importlib.import_module(module), function)(target, save_figure)


def save_figure(fig, target: Path) -> None:
    """Write a matplotlib figure drawn here to `target`, through `shrink`."""
    import matplotlib.pyplot as plt

    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / target.name
        fig.savefig(raw, dpi=100)
        plt.close(fig)
        shrink(raw, target)


def shrink(src: Path, dst: Path) -> None:
    """Copy a PNG as a 256-colour palette image: plots have few colours, and the site stays
    light (each figure well under MAX_BYTES)."""
    from PIL import Image

    with Image.open(src) as im:
        im.convert("RGB").quantize(colors=256).save(dst, optimize=True)
    size = dst.stat().st_size
    if size > MAX_BYTES:
        raise SystemExit(f"{dst.name} is {size} bytes, over {MAX_BYTES}: draw it smaller")


def main(argv: list[str] | None = None) -> int:
    names = [*COMMANDS, *DRAWN]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("figures", nargs="*", help=f"which figures (default: all of {', '.join(names)})")
    p.add_argument("--out", type=Path, default=None, help="draw into this folder instead, "
                   "leaving docs/figures and figures.json as they are (a trial, or the tests)")
    p.add_argument("--keep", type=Path, help="keep each command's run folder (its tables and "
                   "data, and its printed output in stdout.txt) as KEEP/NAME, for the docs")
    args = p.parse_args(argv)
    dest = args.out or HERE
    dest.mkdir(parents=True, exist_ok=True)
    unknown = set(args.figures) - set(names)
    if unknown:
        p.error(f"no figure {', '.join(sorted(unknown))}; choose from {', '.join(names)}")
    manifest = json.loads(MANIFEST.read_text()) if MANIFEST.exists() else {}
    where = machine()
    for name in args.figures or names:
        load = os.getloadavg()[0]
        started = time.time()
        with tempfile.TemporaryDirectory() as tmp:
            if name in COMMANDS:
                command = run_command(name, Path(tmp) / "out", dest)
                if args.keep:
                    shutil.copytree(Path(tmp) / "out", args.keep / name, dirs_exist_ok=True)
            else:
                command = draw(name, dest / f"{name}.png")
        manifest[name] = {"command": command, "machine": where,
                          # 1-minute load average when the run started and when it ended
                          "load_average": [round(load, 1), round(os.getloadavg()[0], 1)],
                          "date": time.strftime("%Y-%m-%d")}
        print(f"{name}.png: {time.time() - started:.0f} s, "
              f"{(dest / f'{name}.png').stat().st_size // 1024} KiB")
        if args.out is None:
            MANIFEST.write_text(json.dumps(dict(sorted(manifest.items())), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
