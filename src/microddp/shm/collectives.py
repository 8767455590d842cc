"""Collectives through shared memory, for a group whose ranks are all on this host.

    from microddp import collectives as C
    C.shm_all_reduce(t)                       # in place, like dist.all_reduce
    work = C.shm_all_reduce(t, async_op=True)  # ... work.wait()

Each group gets its own segment and lane on its first collective here (a collective step:
every rank of the group must make it), kept as long as the group object lives or until
microddp.shutdown(). A group whose ranks are not all on this host, or MICRODDP_TRANSPORT=gloo,
gets none: these functions then raise, and `route.all_reduce_path` picks gloo instead.
Results are the same bits on every rank (shm/group.py says in which order the ranks' values
are combined); like the other collectives here, a write bumps the tensor's autograd version.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import MicroDDPError
from ..transport.peers import written
from ..world import args as comms_args
from ..world.args import check_kind, check_list
from ..world.world import group_rank, group_size
from . import checked as shm_checked
from .attach import attach, wanted
from .group import DTYPES, SharedGroup, segment_bytes, sizes
from .lane import Lane, ShmWork

__all__ = ["shm_all_reduce", "shm_reduce_scatter", "shm_all_gather", "shm_broadcast",
           "shared", "close_all"]


@dataclass
class _State:
    group: SharedGroup | None  # None: this group does not use shared memory
    lane: Lane | None
    # Whether comms may send float sums here too: on 2 ranks (x0 + x1 is gloo's result, bit
    # for bit) or when MICRODDP_TRANSPORT=shm asks for it. On more ranks gloo adds in an order
    # of its own (route.py), so by default those stay on gloo.
    any_order: bool = False

    def close(self) -> None:
        if self.lane is not None:
            self.lane.close()
        if self.group is not None:
            self.group.close()


_states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_setups: dict[tuple[str, str], int] = {}  # set-ups per (kind, group name) in this process


def _key(group):
    return group if group is not None else dist.group.WORLD


def shared(group=None) -> _State | None:
    """The group's shared memory, set up on the first call (collective over the group); None
    when the group talks through its backend instead (another host, a non-gloo backend,
    MICRODDP_TRANSPORT=gloo)."""
    key = _key(group)
    if key is None:  # no default group after all (torch's was never formed, or is gone)
        return None
    state = _states.get(key)
    if state is None:  # set up here, not in an except: its errors are the user's to read
        state = _states[key] = _setup(key)
        weakref.finalize(key, state.close)
    return state if state.group is not None else None


def _setup(key) -> _State:
    size, rank = group_size(key), group_rank(key)
    if size < 2 or rank < 0 or "gloo" not in str(dist.get_backend(key)):
        return _State(None, None)
    name = str(getattr(key, "group_name", "") or "world")
    return open_shared(dist.distributed_c10d._get_default_store(), "shm", name, rank, size,
                       group_timeout_s(key))


def open_shared(store: dist.Store, kind: str, name: str, rank: int, size: int,
                timeout_s: float) -> _State:
    """Set up a group's shared memory through `store` (collective over the group's ranks):
    its segment and lane, or a state without them where the ranks may not share memory
    (shm/attach.py decides). `kind` keeps apart the users of one store (microddp's
    own groups, the torch backend's)."""
    # A prefix of its own for every set-up: the same on every rank of the group (each sets
    # up a group of this name as often as the others), never one used before in this job.
    n = _setups[kind, name] = _setups.get((kind, name), -1) + 1
    slot, small = sizes(size)
    got = attach(store, f"microddp/{kind}/{name}/{n}", rank, size, segment_bytes(size, slot),
                 timeout_s, f"slot={slot} small={small}")
    if got is None:
        return _State(None, None)
    return _State(SharedGroup(got.segment, rank, size, got.pids, timeout_s, slot, small),
                  Lane(name), size == 2 or wanted() == "shm")


def group_timeout_s(key) -> float:
    """The group's own timeout (what its gloo calls wait at most), so a shared-memory wait
    gives up when a gloo one would; MICRODDP_TIMEOUT (or 120 s) if torch does not say."""
    try:
        return key._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError, ValueError):
        return float(os.environ.get("MICRODDP_TIMEOUT", 120.0))


def close_all() -> None:
    """Leave every group's shared memory (microddp.shutdown does, before the groups go)."""
    for state in list(_states.values()):
        state.close()
    _states.clear()


def _required(group, where: str) -> _State:
    state = shared(group)
    if state is None:
        raise MicroDDPError(f"{where}: this group does not use shared memory (its ranks are not "
                            "all on this host, its backend is not gloo, or MICRODDP_TRANSPORT="
                            "gloo); use microddp.comms or the ring instead")
    return state


def _check(tensor, where: str, name: str = "tensor") -> None:
    """What the shared-memory path can move: a dense, contiguous CPU tensor of DTYPES."""
    check_kind(tensor, where, name)
    if tensor.device.type != "cpu" or tensor.layout != torch.strided or not tensor.is_contiguous():
        raise MicroDDPError(f"{where}: {name} must be a dense, contiguous CPU tensor, got "
                            f"{tensor.layout} {tensor.device} (contiguous: "
                            f"{tensor.is_contiguous()}); pass {name}.contiguous() or use comms")
    if tensor.dtype not in DTYPES:
        raise MicroDDPError(f"{where}: {tensor.dtype} is not supported; use one of "
                            f"{', '.join(sorted(str(d) for d in DTYPES))}")


def _check_list(tensors: list, name: str, like: torch.Tensor, like_name: str, size: int,
                where: str) -> None:
    """One tensor per rank of the group, each passing _check, shaped and typed as `like`."""
    check_list(tensors, like, size, where, name, like_name=like_name,
               element=lambda t, n: _check(t, where, n))


def flat_data(t: torch.Tensor) -> torch.Tensor:
    """The tensor's memory as one flat tensor, outside autograd (.data: a collective's write
    is not autograd's business; written() says it where microddp bumps the version)."""
    data = t.data
    return data if data.dim() == 1 else data.view(-1)


def _run(state: _State, body: Callable[[SharedGroup], None], result: list, async_op: bool,
         finish: Callable[[], None] | None = None) -> ShmWork | None:
    group = state.group

    def task(yielding: bool) -> None:
        group.yielding = yielding
        body(group)
        if finish is not None:
            finish()

    return state.lane.submit(task, result, async_op)


def _refused(state: _State, group, where: str, fields: dict, problem: MicroDDPError) -> None:
    """Tell the other ranks, waiting in their first synchronisation, that this rank refuses
    its arguments (so they raise too), then raise `problem`."""
    shm_checked.agree_in_order(state.lane, state.group.agreement, group, where, fields, problem)
    raise problem  # agree_in_order raised it: a defence


def shm_all_reduce(tensor: torch.Tensor, op: str = "sum", group=None,
                   async_op: bool = False) -> ShmWork | None:
    """In place: op (sum, avg, product, min, max) over the group's `tensor`s."""
    where = "shm_all_reduce"
    state = _required(group, where)
    name, problem = str(op), None
    try:
        name = comms_args.op_name(op)
        _check(tensor, where)
        comms_args.check_op_dtype(name, tensor)
        if name not in ("sum", "avg", "product", "min", "max"):
            raise MicroDDPError(f"{where}: op {name!r} is not supported; use comms.all_reduce")
    except MicroDDPError as e:
        problem = e
    fields = shm_checked.tensor_fields(tensor, op=name)
    if problem is not None:
        _refused(state, group, where, fields, problem)
    check = shm_checked.check(state.group.agreement, group, where, fields)
    flat = flat_data(tensor)

    def finish() -> None:
        if name == "avg":
            flat.div_(state.group.size)
        written(tensor)

    return _run(state, lambda g: g.all_reduce(flat, name, check), [tensor], async_op, finish)


def _all_reduce_here(group: SharedGroup, flat: torch.Tensor, op: str, check) -> None:
    """A blocking all-reduce on the caller's thread (the lane's `run_now`), which spins."""
    group.yielding = False
    group.all_reduce(flat, op, check)


def all_reduce_unversioned(tensor: torch.Tensor, op: str, group, async_op: bool) -> ShmWork | None:
    """shm_all_reduce as microddp.comms calls it (route.py), after its own checks: like
    torch's collectives, it leaves autograd's version counter alone, and "avg" is its caller's
    division (summed here). Checked against the other ranks' calls as comms.all_reduce."""
    state = shared(group)
    flat = flat_data(tensor)
    check = (shm_checked.all_reduce_check(state.group.agreement, group, tensor, op)
             if shm_checked.CHECKING else None)
    fold = "sum" if op == "avg" else op
    if not async_op and state.lane.run_now(_all_reduce_here, state.group, flat, fold, check):
        return None
    return _run(state, lambda g: g.all_reduce(flat, fold, check), [tensor], async_op)


def agree_in_order(group, where: str, fields: dict, problem: MicroDDPError | None) -> bool:
    """For a call on `group` that does not go through shared memory: agree with the other
    ranks through the group's segment, in order with its shared-memory calls, and raise on
    every rank if they differ (or this rank's `problem`). False, having done nothing, where
    the group does not use shared memory."""
    state = shared(group)
    if state is None:
        return False
    shm_checked.agree_in_order(state.lane, state.group.agreement, group, where, fields, problem)
    return True


def shm_reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: str = "sum",
                       group=None, async_op: bool = False) -> ShmWork | None:
    """Group rank i ends with op over ranks of their input_list[i]."""
    where = "shm_reduce_scatter"
    state = _required(group, where)
    name, problem = str(op), None
    try:
        name = comms_args.op_name(op)
        _check(output, where, "output")
        comms_args.check_op_dtype(name, output)
        _check_list(input_list, "input_list", output, "output", state.group.size, where)
    except MicroDDPError as e:
        problem = e
    fields = shm_checked.tensor_fields(output, op=name)
    if problem is not None:
        _refused(state, group, where, fields, problem)
    check = shm_checked.check(state.group.agreement, group, where, fields)
    flat, inputs = flat_data(output), [flat_data(t) for t in input_list]

    def finish() -> None:
        if name == "avg":
            flat.div_(state.group.size)
        written(output)

    return _run(state, lambda g: g.reduce_scatter(flat, inputs, name, check), [output],
                async_op, finish)


def shm_all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None,
                   async_op: bool = False) -> ShmWork | None:
    """tensor_list[i] becomes group rank i's `tensor`, on every rank."""
    where = "shm_all_gather"
    state = _required(group, where)
    problem = None
    try:
        _check(tensor, where)
        _check_list(tensor_list, "tensor_list", tensor, "tensor", state.group.size, where)
        if _shares_memory(tensor_list):
            raise MicroDDPError(f"{where}: the tensors of tensor_list share memory, so they "
                                "cannot each hold a rank's tensor; pass tensors of their own")
    except MicroDDPError as e:
        problem = e
    fields = shm_checked.tensor_fields(tensor)
    if problem is not None:
        _refused(state, group, where, fields, problem)
    check = shm_checked.check(state.group.agreement, group, where, fields)
    outputs = [flat_data(t) for t in tensor_list]

    def finish() -> None:
        for t in tensor_list:
            written(t)

    return _run(state, lambda g: g.all_gather(outputs, flat_data(tensor), check),
                list(tensor_list), async_op, finish)


def shm_broadcast(tensor: torch.Tensor, src: int | None = None, group=None,
                  async_op: bool = False, group_src: int | None = None) -> ShmWork | None:
    """Every rank's `tensor` becomes that of global rank `src` (or group rank `group_src`;
    rank 0 if neither)."""
    where = "shm_broadcast"
    state = _required(group, where)
    problem, root, g_src = None, src, 0
    try:
        _check(tensor, where)
        root = comms_args.root(src, group_src, group, "src")
        g_src = root if group is None else dist.get_group_rank(group, root)
    except MicroDDPError as e:
        problem = e
    fields = shm_checked.tensor_fields(tensor, src=root)
    if problem is not None:
        _refused(state, group, where, fields, problem)
    check = shm_checked.check(state.group.agreement, group, where, fields)
    flat = flat_data(tensor)
    return _run(state, lambda g: g.broadcast(flat, g_src, check), [tensor], async_op,
                lambda: written(tensor))


def _shares_memory(tensors: list[torch.Tensor]) -> bool:
    """Whether two of `tensors` (each contiguous) overlap in memory."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                   for t in tensors if t.numel())
    return any(b[0] < a[1] for a, b in zip(spans, spans[1:], strict=False))


for _fn in (shm_all_reduce, shm_reduce_scatter, shm_all_gather, shm_broadcast):
    _fn.ends_itself = True  # the hang monitor: they give up at the group's timeout, as gloo does
