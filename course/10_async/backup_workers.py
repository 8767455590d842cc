"""Chapter 10, step 3: backup workers, the synchronous answer to stragglers. With one worker
4x slower, each step uses the first N-b gradients to arrive and drops the late ones, so the
step no longer waits for the slowest; staleness stays 0.

    python course/10_async/backup_workers.py          # 4 ranks: server + 3 workers
    python course/10_async/backup_workers.py -n 5
"""

from problem import measure, world_size_from_args

import microddp as mdp


def main(world: mdp.World) -> None:
    workers = world.world_size - 1
    slow = {workers: 4.0}
    runs = [(b, measure(world, staleness=0, backup_workers=b, stragglers=slow))
            for b in range(min(2, workers))]
    if world.rank != 0:
        return
    print(f"{workers} workers, rank {workers} 4x slower, synchronous (S=0)")
    print(f"{'backups':>7} {'grads/update':>12} {'updates':>7} {'dropped':>7} {'samples/s':>10} "
          f"{'test acc':>8}")
    for b, r in runs:
        used = sorted(set(r["per_update"]))
        print(f"{b:>7} {','.join(map(str, used)):>12} {r['updates']:>7} {r['discarded']:>7} "
              f"{r['samples_per_s']:>10.0f} {r['accuracy']:>8.3f}")
    base, backed = runs[0][1], runs[-1][1]
    print(f"samples/s with {runs[-1][0]} backup / without: "
          f"{backed['samples_per_s'] / base['samples_per_s']:.2f}")


if __name__ == "__main__":
    mdp.spawn(main, world_size_from_args(__doc__, default=4), backend="gloo", timeout=600)
