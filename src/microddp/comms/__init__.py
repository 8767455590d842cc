"""Joining the job and talking in it: the world (`init`, `shutdown`, `World`), how ranks meet
(rendezvous), and typed wrappers over torch.distributed's operations (ops).

`microddp.comms.all_reduce`, `microddp.comms.init`, ... are the names users call; the
modules behind them are world.py, rendezvous.py, ops.py, args.py, handle.py, teardown.py.
"""

from .ops import (
    REDUCE_OPS,
    Handle,
    World,
    all_gather,
    all_reduce,
    all_reduce_mean,
    barrier,
    broadcast,
    gather,
    get_world,
    group_rank,
    group_size,
    init,
    irecv,
    is_initialized,
    isend,
    new_group,
    recv,
    reduce,
    reduce_scatter,
    scatter,
    send,
    shutdown,
)
from .world import distributed, given_group

__all__ = [
    "World", "init", "shutdown", "get_world", "is_initialized", "distributed", "Handle",
    "REDUCE_OPS", "all_reduce", "all_reduce_mean", "broadcast", "all_gather", "reduce_scatter",
    "reduce", "scatter", "gather", "barrier", "send", "recv", "isend", "irecv", "new_group",
    "group_size", "group_rank", "given_group",
]
