"""The sharding plan: which elements of which parameters each rank owns.

Parameters are laid end to end in flat buckets, and each bucket is cut by elements, not by
whole parameters: every rank owns `numel // N` or one more, so shards are balanced to within
one element whatever the parameter sizes (torch's ZeroRedundancyOptimizer hands out whole
parameters greedily, so one large tensor can leave a rank with most of the state). The rank
that gets a bucket's spare element rotates from bucket to bucket, so the totals over the whole
model are balanced to within one element too.

On the wire a bucket is its parameters end to end, rank r's part from element `start(r)`
(collectives per rank, so parts need not be equal). `cap` is the largest part: what an
equal-chunk collective would pad every part to. A parameter may straddle two ranks; `pieces`
says which part of it each rank owns, and where in its part. The plan
is plain data: it can be built, printed and tested without any process group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..dp.buckets import plan_by_size
from ..errors import MicroDDPError


@dataclass(frozen=True)
class Piece:
    """`length` elements of parameter `param` (from element `start` of its flat view) live in
    rank `rank`'s part, from element `offset` of that part."""

    param: int
    start: int
    rank: int
    offset: int
    length: int


@dataclass(frozen=True)
class Bucket:
    """Parameters flattened together and cut into one part per rank.

    `params` index the plan's parameter list; `sizes[r]` is how many elements rank r owns.
    """

    index: int
    group: int
    params: tuple[int, ...]
    numels: tuple[int, ...]
    sizes: tuple[int, ...]
    cap: int
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        """Elements in the bucket, over all its parameters."""
        return sum(self.numels)

    def start(self, rank: int) -> int:
        """Where rank `rank`'s elements begin in the bucket's parameters laid end to end."""
        return sum(self.sizes[:rank])

    @property
    def world_size(self) -> int:
        """Ranks the bucket is sharded over."""
        return len(self.sizes)


@dataclass(frozen=True)
class ShardPlan:
    """Buckets over `numels` (one entry per sharded parameter) for `world_size` ranks."""

    world_size: int
    numels: tuple[int, ...]
    groups: tuple[int, ...]
    buckets: tuple[Bucket, ...]

    def owned(self, rank: int) -> int:
        """Elements rank `rank` owns over all buckets."""
        return sum(b.sizes[rank] for b in self.buckets)

    def describe(self) -> str:
        """One line per bucket: its parameters and each rank's share (for the course)."""
        lines = []
        for b in self.buckets:
            shares = " ".join(f"r{r}:{s}" for r, s in enumerate(b.sizes))
            lines.append(f"bucket {b.index} (group {b.group}): params {list(b.params)}, "
                         f"{b.numel} elements, slot {b.cap} -> {shares}")
        return "\n".join(lines)


def split(numel: int, world_size: int, first: int) -> list[int]:
    """`numel` elements over `world_size` ranks, within one element; the spare ones go to
    ranks first, first+1, ... (mod world_size)."""
    base, spare = divmod(numel, world_size)
    sizes = [base] * world_size
    for j in range(spare):
        sizes[(first + j) % world_size] += 1
    return sizes


def _pieces(params: Sequence[int], numels: Sequence[int], sizes: Sequence[int]) -> list[Piece]:
    starts = [sum(sizes[:r]) for r in range(len(sizes))]
    out, at = [], 0
    for p, n in zip(params, numels, strict=True):
        for r, (s, z) in enumerate(zip(starts, sizes, strict=True)):
            lo, hi = max(at, s), min(at + n, s + z)
            if lo < hi:
                out.append(Piece(param=p, start=lo - at, rank=r, offset=lo - s, length=hi - lo))
        at += n
    return out


def build(numels: Sequence[int], groups: Sequence[int], bucket_params: Sequence[Sequence[int]],
          world_size: int) -> ShardPlan:
    """A plan for parameters of sizes `numels` in parameter groups `groups`, bucketed as
    `bucket_params` (lists of parameter indices, each from one group, each parameter once)."""
    if world_size < 1:
        raise MicroDDPError(f"world size must be at least 1, got {world_size}")
    seen = [i for b in bucket_params for i in b]
    if sorted(seen) != list(range(len(numels))):
        raise MicroDDPError("a sharding plan needs every parameter in exactly one bucket; got "
                            f"buckets {list(map(list, bucket_params))} for {len(numels)} "
                            "parameters")
    buckets, spare_so_far = [], 0
    for index, params in enumerate(bucket_params):
        group_ids = {groups[i] for i in params}
        if len(group_ids) > 1:
            raise MicroDDPError(f"bucket {index} mixes parameter groups {sorted(group_ids)}; "
                                "a bucket must hold parameters of one group")
        group = group_ids.pop() if group_ids else 0
        sizes_numel = tuple(numels[i] for i in params)
        total = sum(sizes_numel)
        sizes = split(total, world_size, spare_so_far % world_size)
        spare_so_far += total % world_size
        buckets.append(Bucket(index=index, group=group, params=tuple(params),
                              numels=sizes_numel, sizes=tuple(sizes), cap=max(sizes),
                              pieces=tuple(_pieces(params, sizes_numel, sizes))))
    return ShardPlan(world_size=world_size, numels=tuple(numels), groups=tuple(groups),
                     buckets=tuple(buckets))


def by_size(numels: Sequence[int], groups: Sequence[int], cap_elements: int,
            first_cap_elements: int | None = None) -> list[list[int]]:
    """Buckets for gradient reduction, planned as DDP plans its rebuilt buckets
    (dp.buckets.plan_by_size): parameters in reverse order (the order backward makes their
    gradients ready), one open bucket per parameter group, each closed once it holds its cap
    or more. The first bucket's cap is `first_cap_elements` if given: a small first bucket
    (DDP's 1 MiB) starts communicating while most of backward is still to run."""
    limits = [cap_elements] if not first_cap_elements else [first_cap_elements, cap_elements]
    return plan_by_size(numels, groups, limits, order=range(len(numels) - 1, -1, -1))
