"""ZeRO: data parallelism with sharded model state (course chapter 9).

torch's shapes: `ZeroRedundancyOptimizer` (ZeRO-1, an optimizer to pair with any DDP) and
`fully_shard` (FSDP2's per-module sharding, ZeRO-3). The teaching API below:

Stage 1 shards the optimizer state, stage 2 the gradients too, stage 3 the parameters too;
each trains to the same parameters as plain data parallelism.

    from microddp import zero
    model = zero.Zero(module, torch.optim.AdamW, stage=3, lr=1e-3)
"""

from ..monitor.memory import measure
from .comm import CountingAllReduce
from .engine import STAGES, Zero
from .fsdp import FSDPModule, MixedPrecisionPolicy, clip_grad_norm_, fully_shard
from .optimizer import ZeroRedundancyOptimizer
from .plan import Bucket, Piece, ShardPlan, build, by_size, split

__all__ = ["STAGES", "Bucket", "CountingAllReduce", "FSDPModule", "MixedPrecisionPolicy", "Piece",
           "ShardPlan", "Zero", "ZeroRedundancyOptimizer", "build", "by_size", "clip_grad_norm_",
           "fully_shard", "measure", "split"]
