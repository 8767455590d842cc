"""ZeRO: data parallelism with sharded model state (course chapter 9).

Stage 1 shards the optimizer state, stage 2 the gradients too, stage 3 the parameters too;
each trains to the same parameters as plain data parallelism.

    from microddp import zero
    model = zero.Zero(module, torch.optim.AdamW, stage=3, lr=1e-3)
"""

from ..monitor.memory import measure
from .comm import CountingAllReduce
from .engine import STAGES, Zero
from .plan import Bucket, Piece, ShardPlan, build, by_size, split

__all__ = ["STAGES", "Bucket", "CountingAllReduce", "Piece", "ShardPlan", "Zero", "build",
           "by_size", "measure", "split"]
