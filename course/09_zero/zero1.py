"""Chapter 9: ZeRO-1, the optimizer state is sharded. Each rank still computes the full gradient; at the
step the gradients are reduce-scattered (each rank receives the average of its shard only),
each rank steps its shard with Adam (so Adam's moments exist for 1/N of the parameters), and
the updated shards are all-gathered into every rank's full copy of the parameters.

    python course/09_zero/zero1.py          # 2 ranks
    python course/09_zero/zero1.py -n 4
"""

from problem import HEADER, NAMES, checksum, row, same, train, world_size_from_args

import microddp as mdp

STAGE = 1


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
