"""Thin, typed wrappers over torch.distributed's operations.

Why wrap at all: one spelling for reduce ops (`"sum"`, `"avg"`, ...), `avg` on every backend
(gloo has no native average on older torch), a world of one process that works without a
process group, and clear errors instead of backend-specific ones (args.py). Ranks
(`src`, `dst`) are global ranks, as in torch.distributed; torch's `group_src`/`group_dst`
(ranks inside `group`) are accepted too, and without either a rooted call takes rank 0.

Otherwise they do what torch.distributed does: on a rank outside `group` a call is skipped
(torch warns, tensors are left alone, the result is None even with async_op=True, recv
returns -1), and tensors that require grad are written in place without bumping autograd's
version counter (microddp.collectives, by contrast, bump it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from ..collectives.route import agree_call, all_reduce_path
from ..collectives.route import prepare as prepare_route
from ..errors import MicroDDPError
from ..monitor import messages
from ..monitor.patch import after, point_to_point
from ..world.args import (
    REDUCE_OPS,
    check_list,
    check_op_dtype,
    check_tensor,
    even_sizes,
    op_name,
    peer,
    root,
)
from ..world.arrival import all_arrive
from ..world.world import (
    World,
    given_group,
    group_rank,
    group_size,
    group_timeout,
    is_initialized,
)
from .handle import Handle
from .p2p import RecvWork, SendWork
from .session import distributed, get_world, init, shutdown

__all__ = [
    "World", "init", "shutdown", "get_world", "is_initialized", "Handle", "REDUCE_OPS",
    "all_reduce", "all_reduce_mean", "broadcast", "all_gather", "reduce_scatter", "reduce",
    "scatter", "gather", "barrier", "send", "recv", "isend", "irecv", "new_group",
    "group_size", "group_rank",
]

Op = str  # one of REDUCE_OPS; a dist.ReduceOp is accepted too


def _outside(group) -> bool:
    """This rank is not in `group`: torch skips the call here, and so do the wrappers."""
    return group is not None and distributed() and dist.get_rank(group) < 0


def _done(async_op: bool, finish: Callable[[], None] | None = None,
          result: list | None = None) -> Handle | None:
    """A single-process operation: already finished."""
    if finish is not None:
        finish()
    return Handle(result=result) if async_op else None


def _result(work, async_op: bool, finish: Callable[[], None] | None = None) -> Handle | None:
    """A handle on `work` (None: a call that has already finished)."""
    handle = Handle(work, finish)
    if async_op:
        return handle
    handle.wait()
    return None


def _divide(tensor: torch.Tensor, n: int) -> Callable[[], None]:
    # `.data`: a Parameter may be averaged in place, as torch's collectives write it (no
    # "leaf Variable" error), and autograd's version counter is left alone, as torch leaves it.
    return lambda: tensor.data.div_(n)


# (op, dtype) pairs all_reduce has checked: whether an op means anything for a dtype depends on
# the dtype alone, and a 4 KiB all-reduce through shared memory takes a few microseconds of
# Python, of which the check was one.
_CHECKED: set[tuple[str, torch.dtype]] = set()


def _none() -> None:
    """No agreement (a group torch does not know)."""


def _problem(check: Callable[[], object]) -> MicroDDPError | None:
    """The error `check()` raises (this rank's own complaint about its arguments), or None:
    kept to tell the other ranks (route's agree) before raising it, so they raise too."""
    try:
        check()
    except MicroDDPError as e:
        return e
    return None


def _agree(where: str, group, problem: MicroDDPError | None, tensor, **more) -> None:
    """Before a call goes to the group's backend: the same MicroDDPError on every rank unless
    every rank passed alike arguments (collectives/route.py's agree_call)."""
    agree_call(where, group, problem, tensor, **more)
    if problem is not None:
        raise problem


def _agreed(where: str, group, problem: MicroDDPError | None, tensor, **more) -> Callable:
    """The agreement of a call this rank can make (one it refuses raises here, on every
    rank), to run inside the monitored call with `after`: a peer that never comes is then
    reported as this call (`where` #n), not as "a collective"."""
    if problem is not None:
        _agree(where, group, problem, tensor, **more)
    return lambda: agree_call(where, group, None, tensor, **more)


def _all_reduce_problem(tensor, op) -> tuple[str, MicroDDPError | None]:
    """The op's name and this rank's problem with all_reduce's arguments, if any."""
    try:
        check_tensor(tensor, "all_reduce")
        name = op if isinstance(op, str) and op in REDUCE_OPS else op_name(op)
        if (name, tensor.dtype) not in _CHECKED:
            check_op_dtype(name, tensor)
            _CHECKED.add((name, tensor.dtype))
        return name, None
    except MicroDDPError as e:
        return str(op), e


def all_reduce(tensor: torch.Tensor, op: Op = "sum", group=None,
               async_op: bool = False, checked: bool = True) -> Handle | None:
    """Every rank ends with op(tensor of rank 0, ..., tensor of rank n-1), in place.

    The ranks first agree that they passed the same shape, dtype and op: in the group's shared
    memory at no extra wait, else (ranks on several hosts, MICRODDP_TRANSPORT=gloo) by a round
    of small messages before the call. `checked=False` skips that round, for callers whose
    ranks agreed their calls already (DDP's buckets, checked when DDP was built): a mismatch
    then is gloo's (a wrong number, a hang or an abort)."""
    name, problem = _all_reduce_problem(tensor, op)
    given = given_group(group)  # its own methods, no default group needed, no shared memory
    if not (given or distributed()) or (not given and _outside(group)):
        if problem is not None:
            raise problem
        if not distributed():
            return _done(async_op, result=[tensor])
        return dist.all_reduce(tensor, REDUCE_OPS[name], group, async_op)
    finish = _divide(tensor, group_size(group)) if name == "avg" else None
    fast = all_reduce_path(tensor, name, group) if problem is None and not given else None
    if fast is not None:  # shared memory between the ranks of this host (collectives/route.py)
        work = fast(tensor, name, group, async_op)  # checked in its own synchronisation
        if work is None and not async_op:  # done already, on this thread: no handle to make
            if finish is not None:
                finish()
            return None
        return _result(work, async_op, finish)
    if given and problem is not None:  # a group torch does not know: no agreement through it
        raise problem
    if not checked and problem is not None:
        raise problem
    agreement = (_agreed("all_reduce", group, problem, tensor, op=name)
                 if checked and not given else _none)
    return _result(after(agreement, dist.all_reduce, tensor, REDUCE_OPS[name], group,
                         async_op=True), async_op, finish)


def all_reduce_mean(tensor: torch.Tensor, group=None, async_op: bool = False) -> Handle | None:
    """The average over ranks, in place: what data parallelism does to gradients."""
    return all_reduce(tensor, "avg", group, async_op)


def broadcast(tensor: torch.Tensor, src: int | None = None, group=None,
              async_op: bool = False, group_src: int | None = None) -> Handle | None:
    """Every rank ends with rank `src`'s tensor (global rank; or torch's `group_src`), in
    place. Without either, rank 0's."""
    if _outside(group):
        return dist.broadcast(tensor, group=group, async_op=async_op,
                              **_skipped_root("src", src, group_src))
    got: list[int] = []
    problem = _problem(lambda: (check_tensor(tensor, "broadcast"),
                                got.append(root(src, group_src, group, "src"))))
    if not distributed():
        if problem is not None:
            raise problem
        return _done(async_op, result=[tensor])
    agreement = _agreed("broadcast", group, problem, tensor, src=got[0] if got else src)
    return _result(after(agreement, dist.broadcast, tensor, got[0], group, async_op=True),
                   async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None,
               async_op: bool = False) -> Handle | None:
    """tensor_list[i] becomes rank i's tensor, on every rank."""
    if _outside(group):
        return dist.all_gather(tensor_list, tensor, group, async_op)
    problem = _problem(lambda: (check_tensor(tensor, "all_gather", written=False),
                                _per_rank(tensor_list, tensor, group, "all_gather", "tensor_list", True)))
    if not distributed():
        if problem is not None:
            raise problem
        return _done(async_op, lambda: tensor_list[0].copy_(tensor), list(tensor_list))
    agreement = _agreed("all_gather", group, problem, tensor)
    return _result(after(agreement, dist.all_gather, tensor_list, tensor, group, async_op=True),
                   async_op)


def _per_rank(tensors, like: torch.Tensor, group, what: str, name: str,
              written: bool = False) -> None:
    """One tensor per rank of `group`, each like `like` (world.args.check_list)."""
    check_list(tensors, like, group_size(group), what, name, written, even_sizes(group, like))


def _op_problem(op, tensor, where: str) -> tuple[str, MicroDDPError | None]:
    """The op's name for a call that takes one, and this rank's problem with it or `tensor`."""
    try:
        check_tensor(tensor, where)
        name = op_name(op)
        check_op_dtype(name, tensor)
        return name, None
    except MicroDDPError as e:
        return str(op), e


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: Op = "sum",
                   group=None, async_op: bool = False) -> Handle | None:
    """Rank i ends with op over ranks of input_list[i]."""
    name, problem = _op_problem(op, output, "reduce_scatter")
    if _outside(group):
        if problem is not None:
            raise problem
        return dist.reduce_scatter(output, input_list, REDUCE_OPS[name], group, async_op)
    problem = problem or _problem(
        lambda: _per_rank(input_list, output, group, "reduce_scatter", "input_list"))
    if not distributed():
        if problem is not None:
            raise problem
        return _done(async_op, lambda: output.copy_(input_list[0]), [output])
    agreement = _agreed("reduce_scatter", group, problem, output, op=name)
    finish = _divide(output, group_size(group)) if name == "avg" else None
    work = after(agreement, dist.reduce_scatter, output, list(input_list), REDUCE_OPS[name],
                 group, async_op=True)
    return _result(work, async_op, finish)


def reduce(tensor: torch.Tensor, dst: int | None = None, op: Op = "sum", group=None,
           async_op: bool = False, group_dst: int | None = None) -> Handle | None:
    """Only rank `dst` (or torch's `group_dst`; rank 0 without either) receives op over
    ranks; other ranks' tensors are left unspecified."""
    name, problem = _op_problem(op, tensor, "reduce")
    if _outside(group):
        if problem is not None:
            raise problem
        return dist.reduce(tensor, op=REDUCE_OPS[name], group=group, async_op=async_op,
                           **_skipped_root("dst", dst, group_dst))
    got: list[int] = []
    problem = problem or _problem(lambda: got.append(root(dst, group_dst, group, "dst")))
    if not distributed():
        if problem is not None:
            raise problem
        return _done(async_op, result=[tensor])
    agreement = _agreed("reduce", group, problem, tensor, op=name, dst=got[0] if got else dst)
    dst = got[0]
    is_dst = dist.get_rank() == dst
    finish = _divide(tensor, group_size(group)) if name == "avg" and is_dst else None
    return _result(after(agreement, dist.reduce, tensor, dst, REDUCE_OPS[name], group,
                         async_op=True), async_op, finish)


def scatter(tensor: torch.Tensor, scatter_list: Sequence[torch.Tensor] | None = None,
            src: int | None = None, group=None, async_op: bool = False,
            group_src: int | None = None) -> Handle | None:
    """Group rank i receives scatter_list[i] from rank `src` (or `group_src`) into `tensor`."""
    if _outside(group):
        return dist.scatter(tensor, None, group=group, async_op=async_op,
                            **_skipped_root("src", src, group_src))
    got: list[int] = []

    def check() -> None:
        check_tensor(tensor, "scatter")
        got.append(root(src, group_src, group, "src"))
        if not distributed() or dist.get_rank() == got[0]:
            _per_rank(scatter_list, tensor, group, "scatter", "scatter_list")

    problem = _problem(check)
    if not distributed():
        if problem is not None:
            raise problem
        return _done(async_op, lambda: tensor.copy_(scatter_list[0]), [tensor])
    agreement = _agreed("scatter", group, problem, tensor, src=got[0] if got else src)
    is_src = dist.get_rank() == got[0]
    work = after(agreement, dist.scatter, tensor, list(scatter_list) if is_src else None,
                 got[0], group, async_op=True)
    return _result(work, async_op)


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None,
           dst: int | None = None, group=None, async_op: bool = False,
           group_dst: int | None = None) -> Handle | None:
    """Rank `dst` (or `group_dst`) receives every rank's tensor: gather_list[i] is group
    rank i's."""
    if _outside(group):
        return dist.gather(tensor, None, group=group, async_op=async_op,
                           **_skipped_root("dst", dst, group_dst))
    got: list[int] = []

    def check() -> None:
        check_tensor(tensor, "gather", written=False)
        got.append(root(dst, group_dst, group, "dst"))
        if not distributed() or dist.get_rank() == got[0]:
            _per_rank(gather_list, tensor, group, "gather", "gather_list", True)

    problem = _problem(check)
    if not distributed():
        if problem is not None:
            raise problem
        return _done(async_op, lambda: gather_list[0].copy_(tensor), [tensor])
    agreement = _agreed("gather", group, problem, tensor, dst=got[0] if got else dst)
    is_dst = dist.get_rank() == got[0]
    work = after(agreement, dist.gather, tensor, gather_list if is_dst else None, got[0], group,
                 async_op=True)
    return _result(work, async_op)


def barrier(group=None, async_op: bool = False) -> Handle | None:
    """Block until every rank of the group has arrived."""
    if not distributed():
        return _done(async_op)
    if _outside(group):
        return dist.barrier(group, async_op)
    # agreed inside the monitored barrier: a rank at another collective is an error on every
    # rank, and a stalled peer is still reported as this barrier
    agreement = _agreed("barrier", group, None, None)
    return _result(after(agreement, dist.barrier, group, async_op=True), async_op)


def send(tensor: torch.Tensor, dst: int | None = None, group=None, tag: int = 0,
         group_dst: int | None = None, checked: bool = True) -> None:
    """Blocking send to global rank `dst` (or torch's `group_dst`); returns once the data
    may be reused. The receiver's size and dtype are checked against this one's (p2p.py);
    `checked=False` skips that round trip, for callers whose ranks agreed the shapes already
    (the pipeline's step agreement): a mismatch then is gloo's (SIGABRT or a half-filled
    buffer)."""
    check_tensor(tensor, "send", written=False)
    if _outside(group):  # torch's isend skips it; its send would fail looking up `dst`
        peer(dst, None, None, "send")
        dist.isend(tensor, dst, group, tag, group_dst=group_dst)
        return
    to = _sender_to(dst, group_dst, group, "send")
    data = tensor.contiguous()
    entry = messages.begin("send", tensor, to, group, tag)
    if checked:
        point_to_point("send", "dst", to, tensor,
                       lambda: SendWork(data, to, group, tag, blocking=True).wait())
    else:
        dist.send(data, to, group, tag)
    messages.end(entry)  # (a failed send stays "started" in a Flight Recorder dump)


def recv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0,
         group_src: int | None = None, checked: bool = True) -> int:
    """Blocking receive into `tensor` from global rank `src` (or `group_src`; any rank if
    neither); returns the sender's global rank, or -1 on a rank outside `group`, as torch.
    `checked`: as send's (both ends must pass the same)."""
    check_tensor(tensor, "recv")
    if _outside(group):
        return dist.recv(tensor, src, group, tag, group_src=group_src)
    into = tensor.contiguous()  # gloo refuses a strided view (a transpose): a buffer, copied
    frm = peer(src, group_src, group, "recv")
    entry = messages.begin("recv", tensor, frm, group, tag)
    if checked:
        work = RecvWork(into, frm, group, tag)
        point_to_point("recv", "src", frm, tensor, work.wait)
        sender = work.sender
    else:
        sender = dist.recv(into, frm, group, tag)
    if into is not tensor:
        tensor.copy_(into)
    messages.end(entry)
    return sender


def isend(tensor: torch.Tensor, dst: int | None = None, group=None, tag: int = 0,
          group_dst: int | None = None, checked: bool = True) -> Handle | None:
    """Start a send; `wait()` on the handle before reusing `tensor` (None outside `group`).
    `checked`: as send's."""
    check_tensor(tensor, "isend", written=False)
    if _outside(group):
        return dist.isend(tensor, dst, group, tag, group_dst=group_dst)
    # a strided view goes as a contiguous copy, which the Work keeps until it is done
    to = _sender_to(dst, group_dst, group, "isend")
    entry = messages.begin("send", tensor, to, group, tag, async_op=True)
    data = tensor.contiguous()
    work = SendWork(data, to, group, tag) if checked else dist.isend(data, to, group, tag)
    if entry is None:
        return Handle(work, result=[tensor])
    entry.work = work  # a dump asks it whether the send is done, if nobody waited yet
    return Handle(work, lambda: messages.end(entry), result=[tensor])


def irecv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0,
          group_src: int | None = None, checked: bool = True) -> Handle | None:
    """Start a receive; `tensor` holds the data once `wait()` returns (None outside `group`).
    `checked`: as send's."""
    check_tensor(tensor, "irecv")
    if _outside(group):
        return dist.irecv(tensor, src, group, tag, group_src=group_src)
    into = tensor.contiguous()  # as recv: a buffer, copied into `tensor` when it is done
    source = peer(src, group_src, group, "irecv")
    entry = messages.begin("recv", tensor, source, group, tag, async_op=True)
    work = RecvWork(into, source, group, tag) if checked else dist.irecv(into, source, group, tag)
    if entry is None:
        return Handle(work, None if into is tensor else (lambda: tensor.copy_(into)),
                      result=[tensor])
    entry.work = work

    def received() -> None:
        if into is not tensor:
            tensor.copy_(into)
        messages.end(entry)

    return Handle(work, received, result=[tensor])


def _skipped_root(name: str, rank: int | None, group_rank: int | None) -> dict:
    """The root to hand torch on a rank outside the group, which skips the call but still
    refuses a missing root, and a global one that is not in the group: the group's first
    rank when neither is given (members take global rank 0 then, and say if it is not in)."""
    if rank is None and group_rank is None:
        return {f"group_{name}": 0}
    return {name: rank, f"group_{name}": group_rank}


def _sender_to(dst: int | None, group_dst: int | None, group, what: str) -> int:
    if dst is None and group_dst is None:
        raise MicroDDPError(f"{what} needs the receiving rank: dst=... (a global rank) or "
                            "group_dst=...")
    return peer(dst, group_dst, group, what)


def new_group(ranks: Sequence[int] | None = None, timeout: float | timedelta | None = None,
              backend: str | None = None, **torch_kwargs):
    """A sub-group of ranks. Every rank must call this, members or not (as in torch).

    torch's arguments, in torch's order (ranks, timeout, backend, ...); `timeout` may be
    seconds, and defaults to the world's (init's), not torch's 30 minutes. Other keyword
    arguments (pg_options, use_local_synchronization, ...) go to torch.
    """
    if isinstance(timeout, str):
        raise MicroDDPError(f"new_group's second argument is the timeout, as in torch, not "
                            f"{timeout!r}; pass the backend by name: backend={timeout!r}")
    world = get_world()
    if not distributed():
        if ranks is not None and list(ranks) != [0]:
            raise MicroDDPError(f"a world of one process has only rank 0, not {list(ranks)}")
        return None
    if ranks is not None:
        bad = [r for r in ranks if not 0 <= r < world.world_size]
        if bad or len(set(ranks)) != len(ranks):
            raise MicroDDPError(f"new_group ranks {list(ranks)} must be distinct ranks "
                                f"between 0 and {world.world_size - 1}")
    if timeout is None:
        timeout = group_timeout()
    kwargs = {"timeout": timedelta(seconds=timeout) if isinstance(timeout, (int, float))
              else timeout}
    if not torch_kwargs.get("use_local_synchronization"):  # else only members call it
        seconds = kwargs["timeout"].total_seconds()
        all_arrive("new_group", list(range(world.world_size)), world.rank, seconds)
    group = dist.new_group(list(ranks) if ranks is not None else None, backend=backend, **kwargs,
                           **torch_kwargs)
    if not _outside(group):
        prepare_route(group)  # its members are all here: agree on shared memory now
    return group
