"""Recursive doubling, and the cheap metadata check built on it.

Recursive doubling (a butterfly) lets every rank end with op over all ranks in ceil(log2 p)
exchange rounds. It serves twice: as `tree_all_reduce` for small tensors, and to make every
rank agree on shapes, dtypes and ops *before* any data moves, so that a mismatch becomes the
same clear error on every rank instead of a hang or a silently wrong result.
"""

from __future__ import annotations

import array
import zlib
from collections.abc import Callable

import torch

from ..errors import MicroDDPError
from ._group import (
    Peers,
    check_tensor,
    try_layout,
    try_list,
    try_op,
    try_root,
    wait_all,
)


def butterfly_(peers: Peers, buf: torch.Tensor, scratch: torch.Tensor,
               combine: Callable[[torch.Tensor, torch.Tensor], object]) -> None:
    """In place: every rank's `buf` becomes combine over all ranks' `buf`, bit-identical.

    For p not a power of two, the first 2*rem ranks pair up (even folds into odd) so that a
    power of two take part; the folded ranks get the result back at the end.
    """
    p, r = peers.size, peers.me
    pof2 = 1 << (p.bit_length() - 1)
    rem = p - pof2
    if r < 2 * rem and r % 2 == 0:
        peers.send(buf, r + 1, 1)
        peers.recv(buf, r + 1, 2)
        return
    if r < 2 * rem:
        peers.recv(scratch, r - 1, 1)
        combine(buf, scratch)
    vr = r // 2 if r < 2 * rem else r - rem
    mask, tag = 1, 3
    while mask < pof2:
        vpeer = vr ^ mask
        peer = 2 * vpeer + 1 if vpeer < rem else vpeer + rem
        wait_all(peers.exchange(buf, peer, scratch, peer, tag))
        combine(buf, scratch)  # same operands on both sides; + and min/max commute exactly
        mask, tag = mask << 1, tag + 1
    if r < 2 * rem:
        peers.send(buf, r - 1, 2)


def _code(value) -> int:
    """A stable integer for a shape, a dtype or a name (Python's hash() differs per process)."""
    return value if isinstance(value, int) else zlib.crc32(repr(value).encode())


def agree(peers: Peers, where: str, device: torch.device, problem: Exception | None = None,
          check: bool = True, settings: dict | None = None, **fields) -> None:
    """Raise the same MicroDDPError on every rank unless all ranks passed equal `fields` (the
    caller's arguments) and `settings` (what the environment chose, e.g. MICRODDP_DUPLEX).

    `problem` is this rank's own complaint about its arguments (found by local checks): it is
    shared too, so that the other ranks raise instead of waiting for a rank that gave up. One
    butterfly over max(v) and max(-v) gives every rank both the maximum and the minimum of
    each field; a field is consistent exactly when they are equal. With `check=False` nothing
    is exchanged and only this rank's own problem is raised.
    """
    if not check or peers.size <= 1:
        if problem is not None:
            raise problem
        return
    settings = settings or {}
    fields = {"arguments": int(problem is not None), **fields, **settings}
    codes = [_code(v) for v in fields.values()]
    # Everything before the first send delays the other ranks too, so this is built and read
    # back the cheap way: from a Python array, and with one tolist (torch.tensor() from a
    # list, slicing and negating tensors cost 25 us more per call, measured).
    buf = torch.frombuffer(array.array("q", codes + [-c for c in codes]), dtype=torch.int64)
    if device.type != "cpu":
        buf = buf.to(device)
    butterfly_(peers, buf, torch.empty_like(buf), lambda a, b: torch.maximum(a, b, out=a))
    k = len(codes)
    out = buf.tolist()
    highs, lows = out[:k], [-v for v in out[k:]]
    if problem is not None:
        raise problem
    if highs[0]:
        raise MicroDDPError(f"{where}: another rank of the group rejected its arguments (its "
                            "error says why); fix them there")
    differ = [name for name, hi, lo in zip(fields, highs, lows, strict=True) if hi != lo]
    if differ:
        # Every argument, but a setting only when it is what differs: otherwise it is noise.
        shown = [n for n in list(fields)[1:] if n not in settings or n in differ]
        mine = ", ".join(f"{name}={fields[name]}" for name in shown)
        raise MicroDDPError(
            f"{where}: ranks disagree on {' and '.join(differ)} (this rank, group rank "
            f"{peers.me}: {mine}); every rank of the group must call it with the same "
            f"{', '.join(differ)}")


def begin_all_reduce(tensor: torch.Tensor, op: str, group, check: bool,
                     where: str, **settings) -> tuple[Peers, str] | None:
    """What every all-reduce does before moving data: validate the tensor and op, and agree
    across ranks on shape, dtype, op and any `settings` the algorithm needs the same on every
    rank. Returns (peers, op name), or None off the group."""
    check_tensor(tensor, where)
    peers = Peers(group)
    if not peers.member:
        return None
    name, problem = try_op(op, tensor, where)
    problem = problem or try_layout(tensor, where)
    agree(peers, where, tensor.device, problem, check, settings,
          shape=tuple(tensor.shape), dtype=tensor.dtype, op=name)
    return (peers, name) if peers.size > 1 else None


def begin_rooted(tensor: torch.Tensor, where: str, group, check: bool, root_name: str,
                 root_rank: int, op=None, parts=None, parts_name: str | None = None,
                 result_in: str = "tensor"):
    """What every rooted collective (broadcast, reduce, scatter, gather) does before moving
    data: validate the tensor, the root (`root_name` is the argument's name, src or dst), the
    op if it takes one and, on the root, its list of per-rank tensors if it takes one; then
    agree across ranks on shape, dtype, op and root. `result_in` says where results are
    written, which must be able to hold them: "tensor" (every rank's), "root" (the root's
    tensor only: reduce) or "list" (the root's list: gather, which only reads `tensor`).
    Returns (peers, group rank of the root, op name or None, the root's list or []), or None
    off the group.
    """
    check_tensor(tensor, where)
    peers = Peers(group)
    if not peers.member:
        return None
    name, problem = try_op(op, tensor, where) if op is not None else (None, None)
    root, root_problem = try_root(peers, root_rank, root_name)
    written = result_in == "tensor" or (result_in == "root" and peers.me == root)
    problem = problem or root_problem or try_layout(tensor, where, written=written)
    items: list = []
    if parts_name is not None and problem is None and peers.me == root:
        items, problem = try_list(parts, tensor, peers.size, where, parts_name,
                                  written=result_in == "list")
    fields = {"shape": tuple(tensor.shape), "dtype": tensor.dtype}
    if op is not None:
        fields["op"] = name
    agree(peers, where, tensor.device, problem, check, **fields, **{root_name: root_rank})
    return peers, root, name, items
