"""Checking the arguments of microddp.comms calls before torch sees them: the reduce op for
the dtype, the root rank, the lists of per-rank tensors, the peer of a send or receive.

torch's own errors for these come from the backend, in its words (gloo: 'invalid root rank:
7'), or not at all: gloo's reduce_scatter aborts the process on a wrong shape.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..errors import MicroDDPError
from .world import distributed, get_world, group_size, uses_nccl

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


def op_name(op: str | dist.ReduceOp) -> str:
    """The name in REDUCE_OPS of `op`: a name in any case, or a dist.ReduceOp."""
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


def check_op_dtype(name: str, tensor: torch.Tensor) -> None:
    """Refuse an op the tensor's dtype has no meaning for (torch: a backend's error)."""
    floating = tensor.is_floating_point() or tensor.is_complex()
    if name in _BITWISE and floating:
        raise MicroDDPError(f"op {name!r} needs an integer or bool tensor, got {tensor.dtype}")
    if name == "avg" and not floating:
        raise MicroDDPError(f"op 'avg' needs a floating-point tensor, got {tensor.dtype}; "
                            "use 'sum' and divide yourself")
    if name in ("min", "max", "product") and tensor.is_complex():  # torch: a ValueError
        raise MicroDDPError(f"op {name!r} is not defined for complex tensors; use 'sum' or 'avg'")


def overlapping(tensor: torch.Tensor) -> bool:
    """Whether two elements may share memory: taken from the smallest stride up, each
    dimension must step past everything the smaller ones span. (A few exotic layouts that do
    not overlap fail this test too; they get the error and a clone() fixes them.)"""
    if tensor.numel() <= 1:
        return False  # nothing to share memory with
    reach = 0  # the furthest offset the smaller dimensions reach
    for stride, size in sorted((st, n) for n, st in zip(tensor.shape, tensor.stride(),
                                                        strict=True) if n > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def check_kind(tensor, what: str, name: str = "tensor") -> torch.Tensor:
    """`tensor` itself if it is a torch.Tensor; else the error naming the call and argument."""
    if not isinstance(tensor, torch.Tensor):
        raise MicroDDPError(f"{what}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    return tensor


def check_layout(tensor: torch.Tensor, what: str, name: str = "tensor",
                 written: bool = True) -> None:
    """Refuse a layout a collective cannot move: a sparse tensor, and, where the result is
    `written` into it in place, one whose elements share memory (an expand()ed or
    overlapping view: gloo writes it wrong, or hangs a rank, or corrupts the heap)."""
    if tensor.layout != torch.strided:
        raise MicroDDPError(f"{what}: {name} is a {tensor.layout} tensor; collectives work on "
                            f"dense tensors: pass {name}.to_dense()")
    if written and not tensor.is_contiguous() and overlapping(tensor):
        raise MicroDDPError(
            f"{what}: {name} {tuple(tensor.shape)} has elements that share memory (an "
            f"expand()ed or as_strided view, strides {tuple(tensor.stride())}), so it cannot "
            f"hold a result in place; pass a tensor of its own, e.g. {name}.clone()")


def check_tensor(tensor, what: str, name: str = "tensor", written: bool = True) -> None:
    """Refuse what a collective cannot take: check_kind, then check_layout."""
    check_layout(check_kind(tensor, what, name), what, name, written)


def check_list(tensors, like: torch.Tensor, size: int, what: str, name: str,
               written: bool = False, even: bool = True, like_name: str = "the tensor",
               element: Callable[[torch.Tensor, str], None] | None = None) -> list:
    """The one check of a collective's per-rank list, for every path (comms, the ring, shared
    memory): `size` tensors, each passing `element` (check_tensor by default) and of `like`'s
    dtype, device and, if `even` (all but NCCL, which takes uneven sizes), shape: gloo's
    reduce_scatter aborts the process on a wrong shape."""
    if tensors is None or isinstance(tensors, torch.Tensor) or len(tensors) != size:
        got = ("None" if tensors is None else "a tensor, not a list"
               if isinstance(tensors, torch.Tensor) else f"{len(tensors)}")
        raise MicroDDPError(f"{what}: {name} must hold one tensor per rank of the group "
                            f"({size}), got {got}")
    for i, t in enumerate(tensors):
        if element is None:
            check_tensor(t, what, f"{name}[{i}]", written)
        else:
            element(t, f"{name}[{i}]")
        if t.dtype != like.dtype or t.device != like.device or (even and t.shape != like.shape):
            raise MicroDDPError(
                f"{what}: {name}[{i}] is {tuple(t.shape)} {t.dtype} on {t.device}, but "
                f"{like_name} is {tuple(like.shape)} {like.dtype} on {like.device}; make them "
                "match")
    return list(tensors)


def even_sizes(group, like: torch.Tensor) -> bool:
    """Whether a per-rank list must hold `like`'s shape exactly: NCCL takes uneven sizes."""
    return not (distributed() and like.is_cuda and uses_nccl(group))


def root(rank: int | None, group_rank: int | None, group, what: str) -> int:
    """The global rank of a collective's root, from `src`/`dst` (a global rank, 0 if neither
    is given) or from torch's `group_src`/`group_dst` (a rank inside `group`). A global one
    must be in the group: torch's own error for one that is not comes from the backend
    (gloo: 'invalid root rank'), or not at all."""
    if group_rank is not None:
        return _from_group_rank(rank, group_rank, group, what)
    ranks = (list(range(get_world().world_size)) if group is None or not distributed()
             else dist.get_process_group_ranks(group))
    if rank is None and 0 not in ranks:
        raise MicroDDPError(f"no {what} given, so the root is global rank 0, which is not in "
                            f"the group (global ranks {ranks}); pass {what}= (a global rank) or "
                            f"group_{what}= (a rank inside it)")
    rank = 0 if rank is None else rank
    if rank not in ranks:
        raise MicroDDPError(f"{what}={rank} is not a rank of the group (global ranks "
                            f"{ranks}); pass a global rank from that list")
    return rank


def peer(rank: int | None, group_rank: int | None, group, what: str) -> int | None:
    """The global rank of the other end of a send or receive, from `dst`/`src` or, as in
    torch, `group_dst`/`group_src`: another rank of this world (None: any, for a receive)."""
    world = get_world()
    if not distributed():
        raise MicroDDPError(f"{what}: a world of one process has no other rank to talk to")
    if group_rank is not None:
        side = "dst" if "send" in what else "src"
        rank = _from_group_rank(rank, group_rank, group, f"{what}: {side}")
    if rank is not None and (not 0 <= rank < world.world_size or rank == world.rank):
        raise MicroDDPError(f"{what}: rank {rank} is not another rank of this world "
                            f"(this is rank {world.rank} of {world.world_size})")
    if rank is not None and group is not None:
        ranks = dist.get_process_group_ranks(group)
        if rank not in ranks:
            raise MicroDDPError(f"{what}: rank {rank} is not in the group (global ranks "
                                f"{ranks}); pass a global rank from that list")
    return rank


def check_group_rank(rank: int | None, group_rank: int, size: int, name: str,
                     where: str = "") -> None:
    """torch's group_src/group_dst: a rank inside a group of `size`, given instead of the
    global `name` (src or dst), not as well. Shared with microddp.collectives."""
    at = f"{where}: " if where else ""
    if rank is not None:
        raise MicroDDPError(f"{at}pass {name} (a global rank) or group_{name} (a rank inside "
                            "the group), not both")
    if not 0 <= group_rank < size:
        raise MicroDDPError(f"{at}group_{name}={group_rank} is not a rank of the group "
                            f"(0 to {size - 1})")


def _from_group_rank(rank: int | None, group_rank: int, group, what: str) -> int:
    check_group_rank(rank, group_rank, group_size(group), what.rpartition(" ")[2], what)
    return dist.get_global_rank(group, group_rank) if distributed() and group else group_rank


