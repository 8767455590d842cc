"""Collectives from scratch, built on point-to-point send/recv only.

Each algorithm gives the same result as torch.distributed's collective of the same name
(bit for bit for integers and min/max, to rounding for float sums and products), on the
default group or on any sub-group. Ranks given as `src`/`dst` are global ranks, as in torch;
torch's `group_src`/`group_dst` (ranks inside the group) are accepted instead.
Every call checks that all ranks passed the same shape, dtype and op, so a mistake is the same
clear MicroDDPError on every rank, never a hang: where the group's ranks share memory, by
writing and reading a few numbers there (shm/agreement.py; the ring on 2 ranks sends its first
step before reading them, agreement/early.py); otherwise with one tiny exchange, which the ring on
2 gloo ranks sends beside its data (agreement/carried.py) and the others send first.

Tensors that require grad (a model's parameters) are written in place like any other, as
torch.distributed does: the algorithms work on a detached view, since a collective is not a
step autograd can differentiate. Unlike torch's, every write bumps the tensor's version, so
autograd refuses a backward through a value that changed under it instead of computing a
wrong gradient.

The shm_* collectives are the exception: they move data through shared memory (microddp.shm,
re-exported here), for a group whose ranks are all on this host, and `route.all_reduce_path`
is where microddp.comms (and so DDP) chooses them over gloo.
"""

from ..shm.collectives import shm_all_gather, shm_all_reduce, shm_broadcast, shm_reduce_scatter
from ..transport.peers import Traffic, traffic
from .hierarchical import Hierarchy, hierarchical_all_reduce
from .naive import gather, naive_all_reduce, scatter
from .ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from .tree import tree_all_reduce, tree_broadcast, tree_reduce

__all__ = [
    "Hierarchy", "Traffic", "traffic", "gather", "hierarchical_all_reduce", "naive_all_reduce", "ring_all_gather", "ring_all_reduce", "ring_reduce_scatter",
    "scatter", "tree_all_reduce", "tree_broadcast", "tree_reduce",
    "shm_all_reduce", "shm_reduce_scatter", "shm_all_gather", "shm_broadcast",
]
