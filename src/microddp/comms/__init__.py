"""Talking in the job: typed wrappers over torch.distributed's operations (ops.py), the
handle of an asynchronous call (handle.py), rank grids and their sub-groups (mesh.py), and
`init`/`shutdown` as users call them (session.py: the world, plus shared memory and the
hang monitor once a group forms).

`microddp.comms.all_reduce`, `microddp.comms.init`, ... are the names users call. This layer
sits above collectives/ and monitor/ and imports what it uses from them directly:
`comms.all_reduce` asks collectives/route.py which path a call takes. The bootstrap below
every layer (the process group, rendezvous, hosts) is world/.
"""

from ..world.world import given_group
from .ops import (
    REDUCE_OPS,
    Handle,
    World,
    all_gather,
    all_reduce,
    all_reduce_mean,
    barrier,
    broadcast,
    distributed,
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

__all__ = [
    "World", "init", "shutdown", "get_world", "is_initialized", "distributed", "Handle",
    "REDUCE_OPS", "all_reduce", "all_reduce_mean", "broadcast", "all_gather", "reduce_scatter",
    "reduce", "scatter", "gather", "barrier", "send", "recv", "isend", "irecv", "new_group",
    "group_size", "group_rank", "given_group",
]
