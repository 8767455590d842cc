"""Chapter 9: ZeRO-1, the optimizer state is sharded. Each rank still computes and keeps the full
gradient; during backward each bucket of gradients is reduce-scattered as soon as it is ready
(each rank receives the average of its shard only), each rank steps its shard with Adam (so
Adam's moments exist for 1/N of the parameters), and the updated shards are all-gathered into
every rank's full copy of the parameters.

    python course/09_zero/zero1.py          # 2 ranks
    python course/09_zero/zero1.py -n 4
"""

from problem import against_dp, world_size_from_args

import microddp as mdp

STAGE = 1

if __name__ == "__main__":
    mdp.spawn(against_dp, world_size_from_args(__doc__), args=(STAGE,), backend="gloo")
