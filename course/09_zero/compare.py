"""Chapter 9: every stage side by side, measured on rank 0 at the optimizer step, with the
check that each trains to plain data parallelism's parameters.

    python course/09_zero/compare.py          # 2 ranks
    python course/09_zero/compare.py -n 4
"""

from problem import HEADER, NAMES, row, same, train, world_size_from_args

import microddp as mdp


def main(world: mdp.World) -> None:
    results = {stage: train(world, stage) for stage in NAMES}
    if world.rank != 0:
        return
    dp_params = results[0][1]
    print(f"rank 0 of {world.world_size}, Adam, fp32, measured at the optimizer step")
    print(HEADER)
    for stage, (memory, params) in results.items():
        print(row(NAMES[stage], memory, "-" if stage == 0 else same(params, dp_params)))


if __name__ == "__main__":
    mdp.spawn(main, world_size_from_args(__doc__), backend="gloo")
