"""A 3-D rank mesh: data-parallel replicas x pipeline stages x tensor-parallel ranks, and the
process sub-groups along each of the three axes, made once.

Rank order, as the field lays it out (Megatron-LM's default): TP innermost, PP outermost,

    rank = stage * (dp * tp) + replica * tp + tp_rank

so a tensor-parallel group is tp consecutive ranks (one host: TP talks in every layer, twice per
block per direction, and needs the fastest link), a stage's replicas are tp apart (they meet once
per step, to average gradients), and a pipeline's stages are dp * tp apart (they exchange one
activation per micro-batch: the cheapest traffic, the one that can cross hosts).

    mesh = Mesh3D(dp=2, pp=2, tp=2)     # 8 ranks
    mesh.coords(5)                      # (1, 0, 1): stage 1, replica 0, tp rank 1
    mesh.tp_ranks(1, 0)                 # [4, 5]
    mesh.pp_ranks(0, 1)                 # [1, 5]: replica 0's pipeline, tp rank 1
    groups = mesh.groups(rank)          # every rank calls it, in one order
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import MicroDDPError
from ..world.world import distributed, group_size
from .ops import new_group


@dataclass(frozen=True)
class Mesh3D:
    """`dp` replicas of a `pp`-stage pipeline whose every stage is split over `tp` ranks."""

    dp: int
    pp: int
    tp: int

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise MicroDDPError(f"a rank mesh needs {name} >= 1, got {value!r}")

    @property
    def size(self) -> int:
        """Ranks in the mesh: dp x pp x tp."""
        return self.dp * self.pp * self.tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(stage, replica, tp rank) of `rank`."""
        if not 0 <= rank < self.size:
            raise MicroDDPError(f"rank {rank} is outside a mesh of dp {self.dp} x pp {self.pp} "
                                f"x tp {self.tp} = {self.size} ranks")
        stage, rest = divmod(rank, self.dp * self.tp)
        replica, t = divmod(rest, self.tp)
        return stage, replica, t

    def rank(self, stage: int, replica: int, t: int) -> int:
        """The rank at (`stage`, `replica`, `t`): the inverse of coords()."""
        return (stage * self.dp + replica) * self.tp + t

    def tp_ranks(self, stage: int, replica: int) -> list[int]:
        """The ranks that split one stage of one replica, tp rank 0 first."""
        return [self.rank(stage, replica, t) for t in range(self.tp)]

    def dp_ranks(self, stage: int, t: int) -> list[int]:
        """The ranks holding the same shard of one stage, replica 0 first."""
        return [self.rank(stage, d, t) for d in range(self.dp)]

    def pp_ranks(self, replica: int, t: int) -> list[int]:
        """One replica's pipeline for tp rank `t`, first stage first."""
        return [self.rank(s, replica, t) for s in range(self.pp)]

    def groups(self, rank: int) -> Mesh3DGroups:
        """This rank's three sub-groups, made once per dimension.

        Every rank makes every group, in the same order (torch creates a group on every rank,
        members or not). A group that is the whole world is None (torch's default group).
        """
        stage, replica, t = self.coords(rank)
        made = {}
        if distributed():
            if group_size() != self.size:
                raise MicroDDPError(f"a mesh of dp {self.dp} x pp {self.pp} x tp {self.tp} needs "
                                    f"{self.size} ranks, the world has {group_size()}")
            for axis, lists, mine in (
                    ("tp", [self.tp_ranks(s, d) for s in range(self.pp) for d in range(self.dp)],
                     self.tp_ranks(stage, replica)),
                    ("dp", [self.dp_ranks(s, u) for s in range(self.pp) for u in range(self.tp)],
                     self.dp_ranks(stage, t)),
                    ("pp", [self.pp_ranks(d, u) for d in range(self.dp) for u in range(self.tp)],
                     self.pp_ranks(replica, t))):
                if len(mine) == self.size:
                    made[axis] = None
                    continue
                for ranks in lists:
                    group = new_group(ranks)
                    if ranks == mine:
                        made[axis] = group
        return Mesh3DGroups(self, stage, replica, t, made.get("tp"), made.get("dp"),
                            made.get("pp"))


@dataclass(frozen=True)
class Mesh3DGroups:
    """One rank's place in a 3-D mesh and its sub-groups (None: the whole world, or a world
    of one)."""

    mesh: Mesh3D
    stage: int
    replica: int
    tp_rank: int
    tp_group: object
    dp_group: object
    pp_group: object
