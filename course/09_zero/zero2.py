"""Chapter 9: ZeRO-2, the gradients are sharded too. During backward, as soon as a bucket of gradients is
complete it is reduce-scattered (asynchronously, while backward goes on) and the full
gradients are freed, so each rank keeps only the averaged gradient of its own shard.

    python course/09_zero/zero2.py          # 2 ranks
    python course/09_zero/zero2.py -n 4
"""

from problem import HEADER, NAMES, checksum, row, same, train, world_size_from_args

import microddp as mdp

STAGE = 2


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
