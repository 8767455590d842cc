"""Chapter 9: ZeRO-3, the parameters are sharded too. Between steps a rank holds only its shard; each layer
is all-gathered just before its forward and freed after, gathered again for its backward,
and the next layer's gather is started early so it overlaps the current layer's compute.

    python course/09_zero/zero3.py          # 2 ranks
    python course/09_zero/zero3.py -n 4
"""

from problem import HEADER, NAMES, checksum, row, same, train, world_size_from_args

import microddp as mdp

STAGE = 3


def main(world: mdp.World) -> None:
    dp, dp_params = train(world, stage=0)
    mine, my_params = train(world, stage=STAGE)
    if world.rank == 0:
        print(f"rank 0 of {world.world_size}, Adam, fp32, measured at the optimizer step")
        print(HEADER)
        print(row(NAMES[0], dp, "-"))
        print(row(NAMES[STAGE], mine, same(my_params, dp_params)))
        print(f"parameter checksum {checksum(my_params):.10f} "
              f"(plain DP: {checksum(dp_params):.10f})")


if __name__ == "__main__":
    mdp.spawn(main, world_size_from_args(__doc__), backend="gloo")
