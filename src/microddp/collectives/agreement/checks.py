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
    """world.args.check_list, returning the error to share instead of raising it."""
    try:
        return comms_args.check_list(tensors, like, size, where, name, written), None
    except MicroDDPError as e:
        return [], e


def try_layout(tensor: torch.Tensor, where: str, name: str = "tensor",
               written: bool = True) -> MicroDDPError | None:
    """world.args.check_layout's error to share, else None. torch refuses an expanded
    tensor only at the end, after the data has moved, and writes an overlapping one wrong."""
    try:
        comms_args.check_layout(tensor, where, name, written)
    except MicroDDPError as e:
        return e
    return None


def try_tensor(tensor, where: str, name: str = "tensor") -> MicroDDPError | None:
    """The error to share if `tensor` is not a tensor at all, else None."""
    try:
        comms_args.check_kind(tensor, where, name)
    except MicroDDPError as e:
        return e
    return None
