"""Chapter 10, step 2: how stale the applied gradients are. With one worker 4x slower, the
server's histogram of staleness (versions between a gradient's parameters and its update) for
a few bounds S; every bar stays at or below S, and S=inf shows the long tail the slow worker
brings. Plus the staleness-aware learning rate (each step divided by its staleness).

    python course/10_async/staleness.py          # 3 ranks: server + 2 workers
    python course/10_async/staleness.py -n 5
"""

import math

from problem import histogram_line, measure, name, world_size_from_args

import microddp as mdp

BOUNDS = [1, 3, math.inf]


def main(world: mdp.World) -> None:
    slow = {world.world_size - 1: 4.0}
    runs = [(s, False, measure(world, staleness=s, stragglers=slow)) for s in BOUNDS]
    runs.append((math.inf, True, measure(world, staleness=math.inf, stragglers=slow,
                                         staleness_lr=True)))
    if world.rank != 0:
        return
    print(f"{world.world_size - 1} workers, rank {world.world_size - 1} 4x slower")
    for s, scaled, r in runs:
        label = name(s) + (" + staleness-aware lr" if scaled else "")
        print(f"{label}: max staleness {max(r['histogram'])}, mean {r['mean_staleness']:.2f}, "
              f"test acc {r['accuracy']:.3f}, {r['samples_per_s']:.0f} samples/s")
        for line in histogram_line(r["histogram"]):
            print(line)


if __name__ == "__main__":
    mdp.spawn(main, world_size_from_args(__doc__), backend="gloo", timeout=600)
