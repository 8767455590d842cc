"""Chapter 10, step 1: synchronous (S=0) against fully asynchronous (S=inf) training, with
every worker equally fast and then with one worker 4x slower. The same samples in every run
(STEPS global batches); measured on this machine: samples/s and test accuracy.

    python course/10_async/sync_vs_async.py          # 3 ranks: server + 2 workers
    python course/10_async/sync_vs_async.py -n 5
"""

import math

from problem import STEPS, measure, name, world_size_from_args

import microddp as mdp

RUNS = [(0, {}), (math.inf, {}), (0, {2: 4.0}), (math.inf, {2: 4.0})]


def main(world: mdp.World) -> list | None:
    rows = [(s, straggler, measure(world, staleness=s, stragglers=straggler))
            for s, straggler in RUNS]
    if world.rank != 0:
        return None
    print(f"{world.world_size - 1} workers, {STEPS} global batches of 64 digits each run")
    print(f"{'mode':<6} {'straggler':<10} {'updates':>7} {'samples/s':>10} {'test acc':>8} "
          f"{'mean staleness':>14}")
    for s, straggler, r in rows:
        slow = ",".join(f"rank {k} x{v:g}" for k, v in straggler.items()) or "none"
        print(f"{name(s):<6} {slow:<10} {r['updates']:>7} {r['samples_per_s']:>10.0f} "
              f"{r['accuracy']:>8.3f} {r['mean_staleness']:>14.2f}")
    for label, (sync, asyn) in (("no straggler", (rows[0][2], rows[1][2])),
                                ("straggler x4", (rows[2][2], rows[3][2]))):
        print(f"async / sync samples/s, {label}: {asyn['samples_per_s'] / sync['samples_per_s']:.2f}")
    return rows


if __name__ == "__main__":
    mdp.spawn(main, world_size_from_args(__doc__), backend="gloo", timeout=600)
