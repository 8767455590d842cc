"""Which way a group's all-reduce goes: the one place that chooses.

`all_reduce_path(tensor, op, group)` answers for microddp.comms.all_reduce, and so for
microddp's DDP, whose buckets go through it: shared memory (shm/collectives.py) when every
rank of the group is on this host (decided once per group, collectively: shm/attach.py),
shared memory handles the call (a dense contiguous CPU tensor of a supported dtype; sum, avg,
product, min or max) and its result is gloo's bit for bit; otherwise None, and the call goes
to the group's backend (gloo, NCCL). Shared memory adds the ranks' values in rank order: on 2
ranks that is gloo's result whatever its order, and integers, min and max never depend on
it, but a float sum or product on 3+ ranks does, so by default that case stays on gloo
(MICRODDP_TRANSPORT=shm sends it through shared memory too; chapter 4c).

`intra_host_path` is the same choice for the hierarchical all-reduce's steps inside a host
(collectives/hierarchical.py), which DDP may take across hosts (chosen once, when it is
built). microddp.comms imports this module: `all_reduce` asks `all_reduce_path`, every
call's agreement is `agree_call`, `init` and `new_group` call `prepare`, `shutdown` `close`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from ..shm import checked as shm_checked
from ..shm import collectives as shm
from ..shm.group import DTYPES, SharedGroup
from ..transport.peers import Peers
from .agreement import agree

OPS = frozenset({"sum", "avg", "product", "min", "max"})
ORDERED = frozenset({"sum", "avg", "product"})  # float results that depend on the order
_this = sys.modules[__name__]


def carries(tensor: torch.Tensor) -> bool:
    """Whether shared memory can carry this tensor: a dense contiguous CPU tensor of one of
    its dtypes (the `microddp` torch backend asks it too, backend/process_group.py)."""
    # is_cpu, not device.type == "cpu": a tenth of the time, on every call of comms.all_reduce
    return (tensor.is_cpu and tensor.dtype in DTYPES
            and tensor.layout is torch.strided and tensor.is_contiguous())


def gives_gloos_bits(any_order: bool, op: str, tensor: torch.Tensor) -> bool:
    """Whether shared memory's result is gloo's to the bit: always, but for float sums and
    products where gloo adds in an order of its own (3+ ranks) and `any_order` was not asked
    for (shm/collectives.py's state says which)."""
    return any_order or op not in ORDERED or not tensor.is_floating_point()


def _fits(tensor: torch.Tensor, op: str) -> bool:
    """Whether shared memory can carry this tensor and op: `carries` it, and one of its ops."""
    return op in OPS and carries(tensor)


def all_reduce_path(tensor: torch.Tensor, op: str, group=None) -> Callable | None:
    """The all-reduce to call for this tensor on this group: shared memory's, or None for the
    group's backend. Every rank of the group must ask at the same point (the first time,
    the ranks agree on the group's transport through the store)."""
    if not _fits(tensor, op):
        return None
    state = shm.shared(group)
    if state is None:
        return None
    if not gives_gloos_bits(state.any_order, op, tensor):
        return None  # 3+ ranks: gloo's order gives other last bits (above)
    # Looked up now, not bound at import: the hang monitor wraps it while it runs.
    return _this.all_reduce


def all_reduce(tensor: torch.Tensor, op: str = "sum", group=None, async_op: bool = False):
    """comms.all_reduce over shared memory (the monitor logs it as all_reduce): torch's
    contract, a Work when async_op, else None once done. `op` "avg" sums (comms divides);
    the ranks' calls are checked in the call's own synchronisation (shm/checked.py)."""
    return shm.all_reduce_unversioned(tensor, op, group, async_op)


# the monitor treats it as it treats gloo's own calls: it ends itself at the group's timeout;
# and, blocking, logs it without taking its caller's frame (monitor/patch.py's `leanly`)
all_reduce.ends_itself = True
all_reduce.lean = True


def intra_host_path(tensor: torch.Tensor, op: str, group) -> SharedGroup | None:
    """The shared memory the hierarchical all-reduce's steps inside a host go through
    (hierarchical.py): `group`'s, if its ranks may use it (decided once per group: every rank
    of the group must ask first at the same point) and shared memory handles this tensor and
    op; else None, and the steps go through gloo's send/recv. No exception for float sums on
    3+ ranks here: the hierarchy adds in an order of its own either way."""
    if not _fits(tensor, op):
        return None
    state = shm.shared(group)
    return state.group if state is not None else None


def agree_call(where: str, group, problem: Exception | None, tensor=None, **more) -> None:
    """Before a comms call that goes through the group's backend: raise the same
    MicroDDPError on every rank unless all passed alike `tensor`'s shape, dtype and device and
    `more` (this rank's `problem`, found by its own checks, is shared first). Through the
    group's shared memory, in order with its calls there, where it has some; else the
    butterfly of agree.py through gloo: for an all_reduce off shared memory a round of small
    messages the caller waits for before the call starts, which DDP's buckets skip
    (comms.all_reduce(checked=False): their shapes were checked when DDP was built). Not on
    NCCL, and not for a barrier (its round is the barrier)."""
    fields = (shm_checked.all_reduce_fields(tensor, more["op"]) if where == "all_reduce"
              else shm_checked.tensor_fields(tensor, **more))
    if shm.agree_in_order(group, where, fields, problem):
        return
    peers = Peers(group)
    if peers.nccl or where == "barrier":  # a barrier's round is the barrier
        if problem is not None:
            raise problem
        return
    if where == "all_reduce":  # gloo takes either layout: contiguity is shared memory's concern
        fields = shm_checked.tensor_fields(tensor, op=more["op"])
    agree.agree(peers, where, torch.device("cpu"), problem, **fields)


def prepare(group) -> None:
    """Decide now, collectively, whether `group` uses shared memory (and attach it): every
    rank of the group calls it at the same point (comms.init, comms.new_group)."""
    shm.shared(group)


def close() -> None:
    """Let go of every group's shared memory (comms.shutdown)."""
    shm.close_all()
