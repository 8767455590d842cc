"""Checking a collective's arguments on this rank, before any exchange: the op for the dtype,
the root, the lists of per-rank tensors, and whether a tensor can hold a result.

Each `try_*` returns the error instead of raising it: `agree.agree` shares it with the
other ranks first, so that all of them raise instead of waiting for a rank that gave up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...errors import MicroDDPError
from ...world import args as comms_args

if TYPE_CHECKING:
    from ...transport.peers import Peers


def op_name(op, tensor: torch.Tensor, where: str) -> str:
    """Validate `op` for `tensor`'s dtype; the same rules as microddp.comms."""
    try:
        name = comms_args.op_name(op)
        comms_args.check_op_dtype(name, tensor)
    except MicroDDPError as e:
        raise MicroDDPError(f"{where}: {e}") from None
    return name


def try_op(op, tensor: torch.Tensor, where: str) -> tuple[str, MicroDDPError | None]:
    """The op's name, or the error to share with the other ranks before raising it."""
    try:
        return op_name(op, tensor, where), None
    except MicroDDPError as e:
        return str(op), e


def try_root(peers: Peers, rank: int | None, what: str,
             group_rank: int | None = None) -> tuple[int, MicroDDPError | None]:
    """The group rank of the root, given as global rank `rank` (a src or dst; 0 if neither
    is given) or, as torch allows, as `group_rank` (group_src, group_dst); or the error."""
    try:
        if group_rank is None:
            return peers.group_rank(0 if rank is None else rank, what), None
        comms_args.check_group_rank(rank, group_rank, peers.size, what)
        return group_rank, None
    except MicroDDPError as e:
        return 0, e


def try_list(tensors, like: torch.Tensor, size: int, where: str, name: str,
             written: bool = False) -> tuple[list, MicroDDPError | None]:
    """check_list, returning the error to share instead of raising it."""
    try:
        return check_list(tensors, like, size, where, name, written), None
    except MicroDDPError as e:
        return [], e


def try_layout(tensor: torch.Tensor, where: str, name: str = "tensor",
               written: bool = True) -> MicroDDPError | None:
    """The error to share when `tensor` cannot be used as it is laid out in memory, else None.

    Sparse tensors are refused: these algorithms move dense memory. Where a result is
    `written` into the tensor in place, one whose elements share memory (an expand()ed view,
    or an overlapping as_strided one) is refused too: it cannot hold a different value in
    each. torch refuses an expanded one only at the end, after the data has moved, and writes
    an overlapping one silently wrong.
    """
    if tensor.layout != torch.strided:
        return MicroDDPError(f"{where}: {name} is a {tensor.layout} tensor; these collectives "
                             f"work on dense tensors: pass {name}.to_dense()")
    if written and _overlapping(tensor):
        return MicroDDPError(
            f"{where}: {name} {tuple(tensor.shape)} has elements that share memory (an expand()ed "
            f"or as_strided view, strides {tuple(tensor.stride())}), so it cannot hold a result "
            f"in place; pass a tensor of its own, e.g. {name}.clone()")
    return None


def _overlapping(tensor: torch.Tensor) -> bool:
    """Whether two elements may share memory (world.args.overlapping)."""
    return comms_args.overlapping(tensor)


def check_tensor(tensor, where: str, name: str = "tensor") -> torch.Tensor:
    """`tensor` itself if it is a tensor; otherwise a MicroDDPError naming the call and argument."""
    if not isinstance(tensor, torch.Tensor):
        raise MicroDDPError(f"{where}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    return tensor


def check_list(tensors, like: torch.Tensor, size: int, where: str, name: str,
               written: bool = False) -> list:
    """A list of `size` tensors, each the same shape, dtype and device as `like` (and, if the
    results are `written` into them, each able to hold one: see try_layout)."""
    if tensors is None or len(tensors) != size:
        got = "None" if tensors is None else f"{len(tensors)} tensors"
        raise MicroDDPError(f"{where}: {name} must hold one tensor per rank of the group "
                            f"({size}), got {got}")
    for i, t in enumerate(tensors):
        check_tensor(t, where, f"{name}[{i}]")
        if t.shape != like.shape or t.dtype != like.dtype or t.device != like.device:
            raise MicroDDPError(
                f"{where}: {name}[{i}] is {tuple(t.shape)} {t.dtype} on {t.device}, but the "
                f"tensor is {tuple(like.shape)} {like.dtype} on {like.device}; make them match")
        problem = try_layout(t, where, f"{name}[{i}]", written)
        if problem is not None:
            raise problem
    return list(tensors)


def try_tensor(tensor, where: str, name: str = "tensor") -> MicroDDPError | None:
    """The error to share if `tensor` is not a tensor at all, else None."""
    try:
        check_tensor(tensor, where, name)
    except MicroDDPError as e:
        return e
    return None
