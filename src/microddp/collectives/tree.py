"""Tree algorithms: binomial-tree broadcast and reduce, recursive-doubling all-reduce.

A tree finishes in ceil(log2 p) rounds instead of p-1, but every round moves the whole
tensor: the right choice when latency dominates (small tensors, many ranks), the wrong one
when bandwidth does (large tensors), where the ring wins.
"""

from __future__ import annotations

import torch

from ..transport.peers import COMBINE, Flat, scratch, wait_all
from .agreement.agree import begin_all_reduce, begin_rooted, butterfly_


def tree_broadcast(tensor: torch.Tensor, src: int | None = None, group=None, *,
                   check: bool = True, group_src: int | None = None) -> torch.Tensor:
    """Every rank ends with global rank `src`'s `tensor` (or, as in torch, that of group
    rank `group_src`; rank 0's without either), in place; returns `tensor`.

    Binomial tree: in round k every rank that already has the data sends it to the rank
    2^k further on (counted from `src`), so the number of holders doubles each round.
    """
    started = begin_rooted(tensor, "tree_broadcast", group, check, "src", src,
                           group_root=group_src)
    if started is None:
        return tensor
    peers, root, _, _ = started
    p = peers.size
    if p == 1:
        return tensor
    flat = Flat(tensor)
    vr = (peers.me - root) % p
    mask = 1
    while mask < p:  # receive once, from the rank that holds the data one round earlier
        if vr & mask:
            peers.recv(flat.data, (vr - mask + root) % p, mask.bit_length())  # tag: the round
            break
        mask <<= 1
    sends = []
    mask >>= 1
    while mask > 0:  # then pass it on to the subtrees below this rank
        if vr + mask < p:
            sends.append(peers.isend(flat.data, (vr + mask + root) % p, mask.bit_length()))
        mask >>= 1
    wait_all(sends)
    return flat.done()


def tree_reduce(tensor: torch.Tensor, dst: int | None = None, op: str = "sum", group=None, *,
                check: bool = True, group_dst: int | None = None) -> torch.Tensor:
    """Global rank `dst` (or group rank `group_dst`; rank 0 without either) ends with op over
    all ranks' `tensor`, in place; returns `tensor`.

    The broadcast tree run backwards: partial results flow up and are combined on the way.
    Other ranks' tensors are left as they were (torch leaves them unspecified).
    """
    started = begin_rooted(tensor, "tree_reduce", group, check, "dst", dst, op=op,
                           result_in="root", group_root=group_dst)
    if started is None:
        return tensor
    peers, root, name, _ = started
    p = peers.size
    if p == 1:
        return tensor
    flat = Flat(tensor)
    vr = (peers.me - root) % p
    acc = flat.data if vr == 0 else None  # interior ranks reduce into a copy, not the input
    incoming = None
    mask = 1
    while mask < p:
        if vr & mask:
            peers.send(flat.data if acc is None else acc, (vr - mask + root) % p,
                       mask.bit_length())
            break
        if vr + mask < p:
            if acc is None:
                acc = flat.data.clone()
            if incoming is None:
                incoming = scratch("tree-reduce", acc.numel(), acc.dtype, acc.device)
            peers.recv(incoming, (vr + mask + root) % p, mask.bit_length())
            COMBINE[name](acc, incoming)
        mask <<= 1
    if vr != 0:
        return tensor
    if name == "avg":
        flat.data.div_(p)
    return flat.done()


def tree_all_reduce(tensor: torch.Tensor, op: str = "sum", group=None, *,
                    check: bool = True) -> torch.Tensor:
    """In place, every rank ends with op over all ranks' `tensor`, in ceil(log2 p) rounds.

    Recursive doubling: in round k each rank swaps its whole partial result with the rank
    2^k away, so latency grows as log p; each round moves the full tensor, so use it for
    small messages.
    """
    where = "tree_all_reduce"
    started = begin_all_reduce(tensor, op, group, check, where)
    if started is None:
        return tensor
    peers, name = started
    flat = Flat(tensor)
    buf = scratch("tree", flat.data.numel(), flat.data.dtype, flat.data.device)
    butterfly_(peers, flat.data, buf, COMBINE[name])
    if name == "avg":
        flat.data.div_(peers.size)
    return flat.done()
