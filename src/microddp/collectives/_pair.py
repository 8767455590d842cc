"""The ring on two ranks, for large tensors: both steps cut into segments, all posted at once.

With p = 2 the ring is one exchange of halves: each rank sends the half the other will own,
adds what it receives into its own half (the reduce-scatter), then sends its finished half
back (the all-gather). Done whole, the add of an 8 MiB half sits between the two exchanges,
with nothing on the wire. Cut into k segments, a segment is added and sent back the moment
it lands, while the next ones are still arriving, so the adds hide behind the transfer.

Unlike the general pipeline (_pipeline.py), nothing here waits for a free buffer: every
receive of the first exchange is posted at once, into one scratch half, because with two
ranks there is only one such exchange. A segment's receive in the second exchange lands in
the half this rank sent first, so it is posted only once that segment's send is done.
"""

from __future__ import annotations

import torch

from ._group import COMBINE, Peers, bounds, scratch, wait_all


def pair_all_reduce_(peers: Peers, data: torch.Tensor, name: str, segments: int) -> None:
    """In place on a 1-D tensor of 2 ranks: op over both, in `segments` messages per step.

    Chunks as bounds() cuts them (rank r owns chunk r), so the result is bit-identical to the
    ring's: each element is combined once, in the same order on both ranks.
    """
    me, other = peers.me, 1 - peers.me
    off = bounds(data.numel(), 2)
    mine, theirs = data[off[me]:off[me + 1]], data[off[other]:off[other + 1]]
    box = scratch("ring-pair", mine.numel(), data.dtype, data.device)
    # The same cuts on both ranks: my j-th piece of `theirs` is the other's j-th of `mine`.
    mine_s, theirs_s, box_s = (t.tensor_split(segments) for t in (mine, theirs, box))
    combine = COMBINE[name]
    k = len(mine_s)
    recvs = [_post(peers.irecv, b, other, 1 + j) for j, b in enumerate(box_s)]
    sends = [_post(peers.isend, t, other, 1 + j) for j, t in enumerate(theirs_s)]
    back = []
    for j in range(k):
        if recvs[j] is not None:
            recvs[j].wait()
            combine(mine_s[j], box_s[j])
            if name == "avg":
                mine_s[j].div_(2)
        back.append(_post(peers.isend, mine_s[j], other, 1 + k + j))
        if sends[j] is not None:
            sends[j].wait()  # that piece of `theirs` is on its way: it may be overwritten now
        back.append(_post(peers.irecv, theirs_s[j], other, 1 + k + j))
    wait_all([w for w in back if w is not None])


def _post(call, tensor: torch.Tensor, peer: int, tag: int):
    """Start a send or receive, or nothing for an empty piece (both ranks skip it alike)."""
    return call(tensor, peer, tag) if tensor.numel() else None
