"""Thin, typed wrappers over torch.distributed's operations.

Why wrap at all: one spelling for reduce ops (`"sum"`, `"avg"`, ...), `avg` on every backend
(gloo has no native average on older torch), a world of one process that works without a
process group, and clear errors instead of backend-specific ones. Ranks (`src`, `dst`) are
global ranks, as in torch.distributed.

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

from .errors import MicroDDPError
from .handle import Handle
from .world import World, get_world, init, is_initialized, shutdown, uses_nccl

__all__ = [
    "World", "init", "shutdown", "get_world", "is_initialized", "Handle", "REDUCE_OPS",
    "all_reduce", "all_reduce_mean", "broadcast", "all_gather", "reduce_scatter", "reduce",
    "scatter", "gather", "barrier", "send", "recv", "isend", "irecv", "new_group",
    "group_size", "group_rank",
]

REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,  # sum then divide: portable across backends and torch versions
    "product": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "band": dist.ReduceOp.BAND,
    "bor": dist.ReduceOp.BOR,
    "bxor": dist.ReduceOp.BXOR,
}
_BITWISE = ("band", "bor", "bxor")
Op = str  # one of REDUCE_OPS; a dist.ReduceOp is accepted too


def _op_name(op: Op | dist.ReduceOp) -> str:
    if isinstance(op, str):
        name = op.lower()
    else:
        # dist.ReduceOp(...) objects (not the ReduceOp.SUM constants) hold their kind in `.op`;
        # they equal the constant only one way round, so a dict lookup would miss them.
        op = getattr(op, "op", op)
        names = {v: k for k, v in REDUCE_OPS.items() if k != "avg"}
        name = names.get(op, "avg" if op == dist.ReduceOp.AVG else "")
    if name not in REDUCE_OPS:
        raise MicroDDPError(f"unknown reduce op {op!r}; choose one of {', '.join(REDUCE_OPS)} "
                            "(or the dist.ReduceOp of that name)")
    return name


def _check_op_dtype(name: str, tensor: torch.Tensor) -> None:
    floating = tensor.is_floating_point() or tensor.is_complex()
    if name in _BITWISE and floating:
        raise MicroDDPError(f"op {name!r} needs an integer or bool tensor, got {tensor.dtype}")
    if name == "avg" and not floating:
        raise MicroDDPError(f"op 'avg' needs a floating-point tensor, got {tensor.dtype}; "
                            "use 'sum' and divide yourself")
    if name in ("min", "max", "product") and tensor.is_complex():  # torch: a ValueError
        raise MicroDDPError(f"op {name!r} is not defined for complex tensors; use 'sum' or 'avg'")


def group_size(group=None) -> int:
    return dist.get_world_size(group) if _distributed() else 1


def group_rank(group=None) -> int:
    """This process's rank inside `group` (-1 if it is not a member)."""
    return dist.get_rank(group) if _distributed() else 0


def _distributed() -> bool:
    return get_world().distributed


def _outside(group) -> bool:
    """This rank is not in `group`: torch skips the call here, and so do the wrappers."""
    return group is not None and _distributed() and dist.get_rank(group) < 0


def _done(async_op: bool, finish: Callable[[], None] | None = None,
          result: list | None = None) -> Handle | None:
    """A single-process operation: already finished."""
    if finish is not None:
        finish()
    return Handle(result=result) if async_op else None


def _result(work, async_op: bool, finish: Callable[[], None] | None = None) -> Handle | None:
    handle = Handle(work, finish)
    if async_op:
        return handle
    handle.wait()
    return None


def _divide(tensor: torch.Tensor, n: int) -> Callable[[], None]:
    # `.data`: a Parameter may be averaged in place, as torch's collectives write it (no
    # "leaf Variable" error), and autograd's version counter is left alone, as torch leaves it.
    return lambda: tensor.data.div_(n)


def all_reduce(tensor: torch.Tensor, op: Op = "sum", group=None,
               async_op: bool = False) -> Handle | None:
    """Every rank ends with op(tensor of rank 0, ..., tensor of rank n-1), in place."""
    name = _op_name(op)
    _check_op_dtype(name, tensor)
    if not _distributed():
        return _done(async_op, result=[tensor])
    if _outside(group):
        return dist.all_reduce(tensor, REDUCE_OPS[name], group, async_op)
    finish = _divide(tensor, group_size(group)) if name == "avg" else None
    return _result(dist.all_reduce(tensor, REDUCE_OPS[name], group, async_op=True),
                   async_op, finish)


def all_reduce_mean(tensor: torch.Tensor, group=None, async_op: bool = False) -> Handle | None:
    """The average over ranks, in place: what data parallelism does to gradients."""
    return all_reduce(tensor, "avg", group, async_op)


def broadcast(tensor: torch.Tensor, src: int = 0, group=None,
              async_op: bool = False) -> Handle | None:
    """Every rank ends with rank `src`'s tensor, in place."""
    if not _distributed():
        _check_root(src, group, "src")
        return _done(async_op, result=[tensor])
    if _outside(group):
        return dist.broadcast(tensor, src, group, async_op)
    _check_root(src, group, "src")
    return _result(dist.broadcast(tensor, src, group, async_op=True), async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None,
               async_op: bool = False) -> Handle | None:
    """tensor_list[i] becomes rank i's tensor, on every rank."""
    if _outside(group):
        return dist.all_gather(tensor_list, tensor, group, async_op)
    _check_list(tensor_list, group, "tensor_list", tensor)
    if not _distributed():
        return _done(async_op, lambda: tensor_list[0].copy_(tensor), list(tensor_list))
    return _result(dist.all_gather(tensor_list, tensor, group, async_op=True), async_op)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: Op = "sum",
                   group=None, async_op: bool = False) -> Handle | None:
    """Rank i ends with op over ranks of input_list[i]."""
    name = _op_name(op)
    _check_op_dtype(name, output)
    if _outside(group):
        return dist.reduce_scatter(output, input_list, REDUCE_OPS[name], group, async_op)
    _check_list(input_list, group, "input_list", output)
    if not _distributed():
        return _done(async_op, lambda: output.copy_(input_list[0]), [output])
    finish = _divide(output, group_size(group)) if name == "avg" else None
    work = dist.reduce_scatter(output, list(input_list), REDUCE_OPS[name], group, async_op=True)
    return _result(work, async_op, finish)


def reduce(tensor: torch.Tensor, dst: int = 0, op: Op = "sum", group=None,
           async_op: bool = False) -> Handle | None:
    """Only rank `dst` receives op over ranks; other ranks' tensors are left unspecified."""
    name = _op_name(op)
    _check_op_dtype(name, tensor)
    if not _distributed():
        _check_root(dst, group, "dst")
        return _done(async_op, result=[tensor])
    if _outside(group):
        return dist.reduce(tensor, dst, REDUCE_OPS[name], group, async_op)
    _check_root(dst, group, "dst")
    is_dst = dist.get_rank() == dst
    finish = _divide(tensor, group_size(group)) if name == "avg" and is_dst else None
    return _result(dist.reduce(tensor, dst, REDUCE_OPS[name], group, async_op=True),
                   async_op, finish)


def scatter(tensor: torch.Tensor, scatter_list: Sequence[torch.Tensor] | None = None,
            src: int = 0, group=None, async_op: bool = False) -> Handle | None:
    """Rank i receives scatter_list[i] from rank `src` into `tensor`."""
    if not _distributed():
        _check_root(src, group, "src")
        _check_list(scatter_list, group, "scatter_list", tensor)
        return _done(async_op, lambda: tensor.copy_(scatter_list[0]), [tensor])
    if _outside(group):
        return dist.scatter(tensor, None, src, group, async_op)
    _check_root(src, group, "src")
    is_src = dist.get_rank() == src
    if is_src:
        _check_list(scatter_list, group, "scatter_list", tensor)
    work = dist.scatter(tensor, list(scatter_list) if is_src else None, src, group,
                        async_op=True)
    return _result(work, async_op)


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None,
           dst: int = 0, group=None, async_op: bool = False) -> Handle | None:
    """Rank `dst` receives every rank's tensor: gather_list[i] is rank i's."""
    if not _distributed():
        _check_root(dst, group, "dst")
        _check_list(gather_list, group, "gather_list", tensor)
        return _done(async_op, lambda: gather_list[0].copy_(tensor), [tensor])
    if _outside(group):
        return dist.gather(tensor, None, dst, group, async_op)
    _check_root(dst, group, "dst")
    is_dst = dist.get_rank() == dst
    if is_dst:
        _check_list(gather_list, group, "gather_list", tensor)
    work = dist.gather(tensor, gather_list if is_dst else None, dst, group, async_op=True)
    return _result(work, async_op)


def barrier(group=None, async_op: bool = False) -> Handle | None:
    """Block until every rank of the group has arrived."""
    if not _distributed():
        return _done(async_op)
    if _outside(group):
        return dist.barrier(group, async_op)
    return _result(dist.barrier(group, async_op=True), async_op)


def _peer(peer: int, what: str) -> None:
    world = get_world()
    if not world.distributed:
        raise MicroDDPError(f"{what}: a world of one process has no other rank to talk to")
    if not 0 <= peer < world.world_size or peer == world.rank:
        raise MicroDDPError(f"{what}: rank {peer} is not another rank of this world "
                            f"(this is rank {world.rank} of {world.world_size})")


def send(tensor: torch.Tensor, dst: int, group=None, tag: int = 0) -> None:
    """Blocking send to rank `dst` (returns once the data may be reused)."""
    _peer(dst, "send")
    if _outside(group):  # torch's isend skips it; its send would fail looking up `dst`
        dist.isend(tensor, dst, group, tag)
        return
    dist.send(tensor, dst, group, tag)


def recv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0) -> int:
    """Blocking receive into `tensor`; returns the sender's rank (any rank if src is None),
    or -1 on a rank outside `group`, as torch does."""
    if src is not None:
        _peer(src, "recv")
    elif not _distributed():
        raise MicroDDPError("recv: a world of one process has no other rank to talk to")
    return dist.recv(tensor, src, group, tag)


def isend(tensor: torch.Tensor, dst: int, group=None, tag: int = 0) -> Handle | None:
    """Start a send; `wait()` on the handle before reusing `tensor` (None outside `group`)."""
    _peer(dst, "isend")
    work = dist.isend(tensor, dst, group, tag)
    return Handle(work, result=[tensor]) if work is not None else None


def irecv(tensor: torch.Tensor, src: int | None = None, group=None,
          tag: int = 0) -> Handle | None:
    """Start a receive; `tensor` holds the data once `wait()` returns (None outside `group`)."""
    if src is not None:
        _peer(src, "irecv")
    work = dist.irecv(tensor, src, group, tag)
    return Handle(work, result=[tensor]) if work is not None else None


def new_group(ranks: Sequence[int] | None = None, timeout: float | timedelta | None = None,
              backend: str | None = None, **torch_kwargs):
    """A sub-group of ranks. Every rank must call this, members or not (as in torch).

    torch's arguments, in torch's order (ranks, timeout, backend, ...); `timeout` may be
    seconds. Other keyword arguments (pg_options, use_local_synchronization, ...) go to torch.
    """
    if isinstance(timeout, str):
        raise MicroDDPError(f"new_group's second argument is the timeout, as in torch, not "
                            f"{timeout!r}; pass the backend by name: backend={timeout!r}")
    world = get_world()
    if not world.distributed:
        if ranks is not None and list(ranks) != [0]:
            raise MicroDDPError(f"a world of one process has only rank 0, not {list(ranks)}")
        return None
    if ranks is not None:
        bad = [r for r in ranks if not 0 <= r < world.world_size]
        if bad or len(set(ranks)) != len(ranks):
            raise MicroDDPError(f"new_group ranks {list(ranks)} must be distinct ranks "
                                f"between 0 and {world.world_size - 1}")
    kwargs = {"timeout": timedelta(seconds=timeout)} if isinstance(timeout, (int, float)) else (
        {"timeout": timeout} if timeout is not None else {})
    return dist.new_group(list(ranks) if ranks is not None else None, backend=backend, **kwargs,
                          **torch_kwargs)


def _check_list(tensors, group, what: str, like: torch.Tensor) -> None:
    """One tensor per rank, each of `like`'s dtype and device and, except on NCCL (which takes
    uneven sizes), of its shape: gloo's reduce_scatter aborts the process on a wrong shape."""
    n = group_size(group)
    if tensors is None or isinstance(tensors, torch.Tensor) or len(tensors) != n:
        got = ("none" if tensors is None else "a tensor, not a list"
               if isinstance(tensors, torch.Tensor) else len(tensors))
        raise MicroDDPError(f"{what} must hold one tensor per rank of the group ({n}), got {got}")
    even = not (_distributed() and like.is_cuda and uses_nccl(group))
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise MicroDDPError(f"{what}[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != like.dtype or t.device != like.device or (even and t.shape != like.shape):
            raise MicroDDPError(
                f"{what}[{i}] is {tuple(t.shape)} {t.dtype} on {t.device}, but the tensor is "
                f"{tuple(like.shape)} {like.dtype} on {like.device}; make them match")


def _check_root(root: int, group, what: str) -> None:
    """`src`/`dst` is a global rank of the group: torch's own error for one that is not comes
    from the backend (gloo: 'invalid root rank'), or not at all."""
    ranks = (range(get_world().world_size) if group is None or not _distributed()
             else dist.get_process_group_ranks(group))
    if root not in ranks:
        raise MicroDDPError(f"{what}={root} is not a rank of the group (global ranks "
                            f"{list(ranks)}); pass a global rank from that list")
