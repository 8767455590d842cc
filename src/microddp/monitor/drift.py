"""Replica drift: are the model copies on all ranks still bit-for-bit the same?

Data parallelism keeps replicas identical only if every rank applies the same update; a
rank-dependent step (a stray seed, a skipped all-reduce) makes them drift silently. Each rank
reduces every parameter to two integers over its raw bits, the ranks exchange the small table,
and the first parameter that differs is named. Cheap enough to run every K steps.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..errors import MicroDDPError
from ..world.world import distributed

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def checksum(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums over the tensor's bits: plain, and position-weighted (catches swaps)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    elif flat.is_complex():  # complex128 is 16 bytes, wider than any integer: compare halves
        flat = torch.view_as_real(flat).reshape(-1)
    bits = flat.view(_INT_OF_SIZE[flat.element_size()]).to(torch.int64)
    weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 65521 + 1
    return torch.stack([bits.sum(), (bits * weights).sum()])


def named_state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters then buffers, in the module's own (rank-independent) order."""
    return list(module.named_parameters()) + [(f"buffer {n}", b) for n, b in
                                              module.named_buffers()]


def check_replicas(module: nn.Module, step: int | None = None, group=None) -> None:
    """Raise MicroDDPError naming the first parameter whose value differs between ranks."""
    if not distributed():
        return
    state = named_state(module)
    if not state:
        return
    device = state[0][1].device
    mine = torch.stack([checksum(t).to(device) for _, t in state])
    size = dist.get_world_size(group)
    table = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(table, mine, group=group)
    # One copy to the host: on a GPU, comparing row by row there would wait for the device
    # once per parameter and rank.
    sums = torch.stack(table).tolist()  # [rank][parameter] -> [plain, weighted]
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    for i, (name, _) in enumerate(state):
        rows = [per_rank[i] for per_rank in sums]
        if all(r == rows[0] for r in rows[1:]):
            continue
        ref = rows[0]
        odd = [ranks[j] for j, r in enumerate(rows) if r != ref]
        when = f" at step {step}" if step is not None else ""
        raise MicroDDPError(
            f"replica drift{when}: parameter {name!r} differs between rank {ranks[0]} and "
            f"rank(s) {','.join(map(str, odd))}; some rank applied a different update (a "
            "rank-dependent seed or step, or gradients not all-reduced) - find what those "
            "ranks do differently")


class DriftCheck:
    """Call `check(step)` every step; it compares replicas every `every` steps."""

    def __init__(self, module: nn.Module, every: int = 100, group=None) -> None:
        if every < 1:
            raise MicroDDPError(f"drift check interval must be at least 1 step, got {every}")
        self.module, self.every, self.group = module, every, group

    def check(self, step: int) -> None:
        """Compare the replicas across ranks if `step` is a multiple of `every`; raises if they
        differ."""
        if step % self.every == 0:
            check_replicas(self.module, step, self.group)
