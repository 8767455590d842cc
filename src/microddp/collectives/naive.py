"""Root-does-everything algorithms: naive all-reduce, and linear scatter and gather.

The first thing anyone writes: every rank sends its tensor to one root, the root combines
and sends the result back. Correct, and the baseline to beat: the root sends and receives
(p-1) whole tensors, so its time grows linearly with the number of ranks.
"""

from __future__ import annotations

import torch

from ..transport.peers import COMBINE, Flat, scratch, wait_all
from .agreement.agree import begin_all_reduce, begin_rooted


def naive_all_reduce(tensor: torch.Tensor, op: str = "sum", group=None, *,
                     check: bool = True) -> torch.Tensor:
    """In place, every rank ends with op over all ranks' `tensor`: reduce at group rank 0,
    then send the result to every rank. Returns `tensor`."""
    where = "naive_all_reduce"
    started = begin_all_reduce(tensor, op, group, check, where)
    if started is None:
        return tensor
    peers, name = started
    p = peers.size
    flat = Flat(tensor)
    if peers.me != 0:
        peers.send(flat.data, 0, 1)  # tag 1 on the way up, 2 on the way down
        peers.recv(flat.data, 0, 2)
        return flat.done()
    incoming = scratch("naive", flat.data.numel(), flat.data.dtype, flat.data.device)
    for src in range(1, p):  # one at a time, in rank order: the root is the bottleneck
        peers.recv(incoming, src, 1)
        COMBINE[name](flat.data, incoming)
    if name == "avg":
        flat.data.div_(p)
    wait_all([peers.isend(flat.data, dst, 2) for dst in range(1, p)])
    return flat.done()


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None,
            src: int | None = None, group=None, *, check: bool = True,
            group_src: int | None = None) -> torch.Tensor:
    """Group rank i receives scatter_list[i] (given on global rank `src`, or group rank
    `group_src`; rank 0 without either) into `tensor`."""
    started = begin_rooted(tensor, "scatter", group, check, "src", src, parts=scatter_list,
                           parts_name="scatter_list", group_root=group_src)
    if started is None:
        return tensor
    peers, root, _, parts = started
    if peers.me != root:
        flat = Flat(tensor)
        peers.recv(flat.data, root)
        return flat.done()
    # Packed copies only for parts that are not contiguous already.
    works = [peers.isend(part.contiguous(), dst) for dst, part in enumerate(parts)
             if dst != root]
    wait_all(works)  # first: `tensor` may be another rank's part, still being sent
    tensor.detach().copy_(parts[root].detach())  # detached, as in Flat
    return tensor


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None,
           dst: int | None = None, group=None, *, check: bool = True,
           group_dst: int | None = None) -> list[torch.Tensor] | None:
    """Global rank `dst` (or group rank `group_dst`; rank 0 without either) receives every
    rank's `tensor`: gather_list[i] is group rank i's.

    Returns gather_list on `dst`, None elsewhere.
    """
    started = begin_rooted(tensor, "gather", group, check, "dst", dst, parts=gather_list,
                           parts_name="gather_list", result_in="list", group_root=group_dst)
    if started is None:
        return None
    peers, root, _, outs = started
    if peers.me != root:
        peers.send(tensor.contiguous(), root)
        return None
    flats = [Flat(out) for out in outs]
    # The root's own part first: `tensor` may also be where another rank's part lands.
    flats[root].data.copy_(tensor.detach().reshape(-1))
    works = [peers.irecv(f.data, i) for i, f in enumerate(flats) if i != root]
    wait_all(works)
    for f in flats:
        f.done()
    return gather_list
