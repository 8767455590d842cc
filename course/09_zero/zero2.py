"""Chapter 9: ZeRO-2, the gradients are sharded too. During backward, as soon as a bucket of gradients is
complete it is reduce-scattered (asynchronously, while backward goes on) and the full
gradients are freed, so each rank keeps only the averaged gradient of its own shard.

    python course/09_zero/zero2.py          # 2 ranks
    python course/09_zero/zero2.py -n 4
"""

from problem import against_dp, world_size_from_args

import microddp as mdp

STAGE = 2

if __name__ == "__main__":
    mdp.spawn(against_dp, world_size_from_args(__doc__), args=(STAGE,), backend="gloo")
