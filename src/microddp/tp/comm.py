"""The four communication steps of Megatron-LM's tensor parallelism, as autograd Functions,
and a ledger that counts what they issue.

Tensor parallelism keeps a region of the model split across the ranks of a group (some heads,
some hidden units, some vocabulary rows) and enters and leaves it through a pair of conjugate
steps, each the other's gradient:

    enter: identity forward, all-reduce backward      (copy_to_region)
    leave: all-reduce forward, identity backward      (reduce_from_region)

Sequence parallelism keeps the rest of the model (norms, dropout, residual) split along the
sequence, and replaces the pair by another: enter all-gathers the sequence forward and
reduce-scatters its gradient backward (gather_sequence); leave reduce-scatters forward and
all-gathers backward (scatter_sequence). An all-reduce is a reduce-scatter then an all-gather,
so the bytes on the wire are the same and the activations between are 1/p as large.

All-reduce goes through microddp.comms (shared memory on one host, else gloo); reduce-scatter
and all-gather through shared memory when the group's ranks share this host, else through
microddp's ring, which sends (p-1)/p of the tensor per rank (gloo's reduce_scatter sends a
whole all-reduce's worth). `counting()` records every call (op, bytes
of the whole tensor, forward or backward), as PyTorch's CommDebugMode does for DTensor.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .. import comms
from ..collectives import ring_all_gather, ring_reduce_scatter, shm_all_gather, shm_reduce_scatter
from ..errors import MicroDDPError
from ..shm.collectives import shared
from .threads import ThreadGroup

SEQ_DIM = 1  # activations are (batch, sequence, features)


@dataclass(frozen=True)
class Call:
    """One collective a layer issued: its name, the bytes of the whole (unsplit) tensor it
    works on, and whether forward or backward issued it."""

    op: str
    bytes: int
    phase: str


_ledgers: list[list[Call]] = []


@contextmanager
def counting() -> Iterator[list[Call]]:
    """Every tensor-parallel collective this rank issues inside the block, in order."""
    calls: list[Call] = []
    _ledgers.append(calls)
    try:
        yield calls
    finally:
        _ledgers.remove(calls)


def _record(op: str, whole: torch.Tensor, phase: str) -> None:
    for ledger in _ledgers:
        ledger.append(Call(op, whole.numel() * whole.element_size(), phase))


def size(group) -> int:
    """The group's size (1 for a world of one)."""
    return group.size if isinstance(group, ThreadGroup) else comms.group_size(group)


def rank(group) -> int:
    """This rank's place in the group."""
    return group.rank if isinstance(group, ThreadGroup) else comms.group_rank(group)


def all_reduce(t: torch.Tensor, group, phase: str, op: str = "sum") -> torch.Tensor:
    """t summed (or op) over the group, in place; a world of one does nothing."""
    if size(group) > 1:
        _record("all_reduce", t, phase)
        if isinstance(group, ThreadGroup):
            group.all_reduce(t, op)
        else:
            comms.all_reduce(t, op, group)
    return t


def all_gather(outs: list[torch.Tensor], t: torch.Tensor, group) -> None:
    """outs[i] becomes group rank i's t (uncounted: a checkpoint's gather, not a step's)."""
    if isinstance(group, ThreadGroup):
        group.all_gather(outs, t)
    else:
        comms.all_gather(outs, t, group)


def _seq_first(x: torch.Tensor) -> torch.Tensor:
    # Sequence first makes each rank's share one contiguous run of memory for the ring.
    return x.movedim(SEQ_DIM, 0).contiguous()


def check_sequence(length: int, group) -> None:
    """Refuse, in one line, a sequence the group cannot split evenly."""
    p = size(group)
    if length % p:
        raise MicroDDPError(f"sequence parallelism needs the sequence length {length} to divide "
                            f"by the tensor-parallel size {p}: pad the sequence or drop --sp")


def reduce_scatter_seq(x: torch.Tensor, group, phase: str) -> torch.Tensor:
    """Sum over the group, each rank keeping its 1/p of the sequence."""
    p = size(group)
    if p == 1:
        return x
    check_sequence(x.shape[SEQ_DIM], group)
    _record("reduce_scatter", x, phase)
    s = _seq_first(x)
    out = torch.empty_like(s[: s.shape[0] // p])
    if isinstance(group, ThreadGroup):
        group.reduce_scatter(out, list(s.chunk(p)))
    elif shared(group) is not None:  # one host: through shared memory (a collective question)
        shm_reduce_scatter(out, list(s.chunk(p)), "sum", group)
    else:
        ring_reduce_scatter(out, list(s.chunk(p)), "sum", group)
    return out.movedim(0, SEQ_DIM).contiguous()  # one copy here, not one per reader


def all_gather_seq(x: torch.Tensor, group, phase: str) -> torch.Tensor:
    """Every rank's share of the sequence, joined in rank order."""
    p = size(group)
    if p == 1:
        return x
    s = _seq_first(x)
    whole = torch.empty((s.shape[0] * p, *s.shape[1:]), dtype=s.dtype, device=s.device)
    _record("all_gather", whole, phase)
    if isinstance(group, ThreadGroup):
        group.all_gather(list(whole.chunk(p)), s)
    elif shared(group) is not None:
        shm_all_gather(list(whole.chunk(p)), s, group)
    else:
        ring_all_gather(list(whole.chunk(p)), s, group)
    return whole.movedim(0, SEQ_DIM).contiguous()  # one copy here, not one per reader


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.contiguous().clone(), ctx.group, "backward"), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.contiguous().clone(), group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_seq(x, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_seq(grad, ctx.group, "backward"), None


class _ScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_seq(x, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return all_gather_seq(grad, ctx.group, "backward"), None


def copy_to_region(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a split region from a replicated one: identity; all-reduce of the gradient."""
    return x if size(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group) -> torch.Tensor:
    """Leave a split region for a replicated one: all-reduce; identity on the gradient."""
    return x if size(group) == 1 else _ReduceFromRegion.apply(x, group)


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a split region from a sequence-split one: all-gather; reduce-scatter backward."""
    return x if size(group) == 1 else _GatherSequence.apply(x, group)


def scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Leave a split region for a sequence-split one: reduce-scatter; all-gather backward."""
    return x if size(group) == 1 else _ScatterSequence.apply(x, group)


def enter(x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """Enter a tensor-parallel region: copy_to_region, or gather_sequence with sequence parallelism."""
    return gather_sequence(x, group) if sequence_parallel else copy_to_region(x, group)


def leave(x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """Leave it: reduce_from_region, or scatter_sequence with sequence parallelism."""
    return scatter_sequence(x, group) if sequence_parallel else reduce_from_region(x, group)


def boundary_calls(whole_bytes: int, sequence_parallel: bool, phase: str, side: str) -> list[Call]:
    """What one enter or leave issues for an activation of `whole_bytes` (the stated figures
    the layers' `comms` add up)."""
    if not sequence_parallel:
        issues = (side == "enter") == (phase == "backward")
        return [Call("all_reduce", whole_bytes, phase)] if issues else []
    gathers = (side == "enter") == (phase == "forward")
    return [Call("all_gather" if gathers else "reduce_scatter", whole_bytes, phase)]
