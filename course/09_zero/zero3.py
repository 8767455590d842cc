"""Chapter 9: ZeRO-3, the parameters are sharded too. Between steps a rank holds only its shard; each layer
is all-gathered just before its forward and freed after, gathered again for its backward,
and the next layer's gather is started early so it overlaps the current layer's compute.

    python course/09_zero/zero3.py          # 2 ranks
    python course/09_zero/zero3.py -n 4
"""

from problem import against_dp, world_size_from_args

import microddp as mdp

STAGE = 3

if __name__ == "__main__":
    mdp.spawn(against_dp, world_size_from_args(__doc__), args=(STAGE,), backend="gloo")
