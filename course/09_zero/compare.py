"""Chapter 9: every stage side by side, measured on rank 0 at the optimizer step, with the
check that each trains to plain data parallelism's parameters.

    python course/09_zero/compare.py          # 2 ranks
    python course/09_zero/compare.py -n 4
"""

from problem import HEADER, NAMES, row, train, world_size_from_args

import microddp as mdp


def main(world: mdp.World) -> None:
    results = {stage: train(world, stage) for stage in NAMES}
    if world.rank != 0:
        return
    dp_sum = results[0][1]
    print(f"rank 0 of {world.world_size}, Adam, fp32, measured at the optimizer step")
    print(HEADER)
    for stage, (memory, total) in results.items():
        same = "-" if stage == 0 else str(abs(total - dp_sum) <= 1e-6 * abs(dp_sum))
        print(row(NAMES[stage], memory, same))


if __name__ == "__main__":
    mdp.spawn(main, world_size_from_args(__doc__), backend="gloo")
