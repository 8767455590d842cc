"""How a context-parallel group splits the sequence: 2P chunks, rank r holds chunk r and chunk
2P-1-r (the "zigzag" of ring attention's causal load balance).

With causal attention a query attends only to keys at or before it. Split the sequence into P
contiguous runs and the last rank would attend to everything while the first attends to its own
run alone: the ring would wait for the slowest rank at every step. Taking one chunk from the
start and its mirror from the end gives every rank the same amount of work at every step of the
ring (ring.py skips the blocks the mask empties).

A rank's tokens are not contiguous, so their positions are not arange(S/P): `positions` gives the
global position of every local token, for the position embedding and for the mask. A sequence that
does not divide by 2P is refused here in one line; `padding` says how many tokens a causal model
appends to make it divide (ContextParallelGPT: exact, since no real token attends to a later one
and the pads are left out of the loss).
"""

from __future__ import annotations

import torch

from .. import comms
from ..errors import MicroDDPError


def size(group=None) -> int:
    """The context-parallel group's size (1 in a world of one)."""
    return comms.group_size(group)


def rank(group=None) -> int:
    """This rank's place in the context-parallel group."""
    return comms.group_rank(group)


def check_sequence(length: int, p: int) -> None:
    """Refuse, in one line, a sequence that 2P chunks cannot split evenly."""
    if p > 1 and length % (2 * p):
        raise MicroDDPError(f"context parallelism needs the sequence length {length} to divide by "
                            f"2 * the context-parallel size {p} = {2 * p}: pad or crop the sequence")


def padding(length: int, p: int) -> int:
    """How many tokens to append so that a `length` sequence splits into 2p equal chunks."""
    return 0 if p == 1 else -length % (2 * p)


def chunks_of(r: int, p: int) -> tuple[int, int]:
    """The two chunk indices (of 2p) that rank r holds: one from the start, its mirror from the end."""
    return r, 2 * p - 1 - r


def positions(length: int, r: int, p: int, device=None) -> torch.Tensor:
    """The global positions of rank r's tokens of a `length` sequence, in local order."""
    check_sequence(length, p)
    if p == 1:
        return torch.arange(length, device=device)
    c = length // (2 * p)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in chunks_of(r, p)])


def shard(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """This rank's two chunks of `x` along `dim` (the whole sequence on every rank, e.g. a batch)."""
    p, r = size(group), rank(group)
    check_sequence(x.shape[dim], p)
    if p == 1:
        return x
    parts = x.chunk(2 * p, dim)
    return torch.cat([parts[i] for i in chunks_of(r, p)], dim)


def unshard(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The whole sequence from every rank's local tensor (in group-rank order): the inverse of shard."""
    p = len(parts)
    if p == 1:
        return parts[0]
    order: list[torch.Tensor | None] = [None] * (2 * p)
    for r, t in enumerate(parts):
        first, second = t.chunk(2, dim)
        a, b = chunks_of(r, p)
        order[a], order[b] = first, second
    return torch.cat(order, dim)  # type: ignore[arg-type]
