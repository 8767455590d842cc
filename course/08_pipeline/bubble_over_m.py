"""Chapter 8, step 4: the bubble over m. GPipe and 1F1B run for real, each stage sleeping a
fixed time (backward twice forward), for more and more micro-batches; the bubble measured
from the recorded timeline follows theory's (p-1)/(m+p-1) down.

    python course/08_pipeline/bubble_over_m.py                       # 4 ranks, m = 1 .. 16
    python course/08_pipeline/bubble_over_m.py -n 2 -m 1 2 4 --png bubble.png
"""

import argparse

from problem import DEPTH, bubble, timed_step

import microddp as mdp

COST = 0.01  # seconds a stage's forward sleeps; its backward sleeps twice that
SCHEDULES = ("gpipe", "1f1b")


def measure(world: mdp.World, ms: list[int]) -> dict:
    return {(name, m): timed_step(world, name, m, cost=COST) for m in ms for name in SCHEDULES}


def draw(n: int, ms: list[int], measured: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ms, [(n - 1) / (m + n - 1) for m in ms], "k--", label="theory (p-1)/(m+p-1)")
    for name in SCHEDULES:
        ax.plot(ms, [measured[name, m] for m in ms], "o-", label=f"{name}, measured")
    ax.set(xscale="log", xlabel="micro-batches m", ylabel="bubble (idle share of the step)",
           title=f"{n} ranks, each stage sleeping {COST * 1e3:g} ms forward")
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--world-size", type=int, default=4, help="ranks (pipeline stages)")
    p.add_argument("-m", "--microbatches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--png", default=None, help="also draw the plot into this file")
    args = p.parse_args()
    n, ms = args.world_size, sorted(set(args.microbatches))
    if not 1 <= n <= DEPTH or min(ms) < 1 or max(ms) > 24:
        p.error(f"-n {n} -m {ms}: use 1 to {DEPTH} ranks and 1 to 24 micro-batches (the "
                "batch has 24 samples)")
    timelines = mdp.spawn(measure, n, args=(ms,), backend="gloo")
    measured = {case: bubble([rank[case] for rank in timelines]) for case in timelines[0]}
    print(f"{n} ranks, each stage sleeping {COST * 1e3:g} ms forward, {2 * COST * 1e3:g} ms "
          "backward; bubble = idle share of the step, from the recorded timeline")
    print(f"{'m':>4}{'theory':>9}" + "".join(f"{name:>9}" for name in SCHEDULES))
    for m in ms:
        print(f"{m:>4}{(n - 1) / (m + n - 1):>9.3f}"
              + "".join(f"{measured[name, m]:>9.3f}" for name in SCHEDULES))
    if args.png:
        draw(n, ms, measured, args.png)
        print(f"wrote {args.png}")
