"""A rank mesh: the world's ranks laid out as a grid of data-parallel replicas x pipeline
stages, and the process sub-groups along each axis.

Rank r sits at replica r // pp, stage r % pp: one replica's pipeline is pp consecutive ranks
(the neighbours that exchange activations every micro-batch), and a stage's data-parallel
group is every pp-th rank (they meet once per step, to average gradients).

    mesh = Mesh(dp=2, pp=2)          # ranks 0 1 | 2 3: two pipelines of two stages
    mesh.pp_ranks(1)                 # [2, 3]: replica 1's pipeline
    mesh.dp_ranks(0)                 # [0, 2]: stage 0's replicas
    groups = mesh.groups(rank)       # this rank's sub-groups (every rank must call it)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import MicroDDPError
from ..world.world import distributed
from .ops import new_group


@dataclass(frozen=True)
class Mesh:
    """`dp` replicas of a `pp`-stage pipeline over dp * pp ranks."""

    dp: int
    pp: int

    def __post_init__(self) -> None:
        for name, value in (("dp", self.dp), ("pp", self.pp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise MicroDDPError(f"a rank mesh needs {name} >= 1, got {value!r}")

    @property
    def size(self) -> int:
        """Ranks in the mesh: dp x pp."""
        return self.dp * self.pp

    def coords(self, rank: int) -> tuple[int, int]:
        """(replica, stage) of `rank`."""
        if not 0 <= rank < self.size:
            raise MicroDDPError(f"rank {rank} is outside a mesh of {self.dp} x {self.pp} = "
                                f"{self.size} ranks")
        return divmod(rank, self.pp)

    def rank(self, replica: int, stage: int) -> int:
        """The rank at (`replica`, `stage`): the inverse of coords()."""
        return replica * self.pp + stage

    def pp_ranks(self, replica: int) -> list[int]:
        """The ranks of one replica's pipeline, first stage first."""
        return [self.rank(replica, s) for s in range(self.pp)]

    def dp_ranks(self, stage: int) -> list[int]:
        """The ranks holding one stage, replica 0 first."""
        return [self.rank(d, stage) for d in range(self.dp)]

    def groups(self, rank: int) -> MeshGroups:
        """This rank's pipeline and data-parallel sub-groups.

        Every rank must call it, in the same order, because torch creates every group on
        every rank (members or not). A group that is the whole world is None (torch's
        default group); so is the data-parallel group of a stage without replicas (dp = 1),
        which has nothing to average.
        """
        replica, stage = self.coords(rank)
        pp_group = dp_group = None
        if distributed() and self.dp > 1:  # with one replica, its pipeline is the world
            for d in range(self.dp):
                made = new_group(self.pp_ranks(d))  # one rank each if pp == 1: a pipeline still
                pp_group = made if d == replica else pp_group
            if self.pp > 1:  # with one stage, its replicas are the world
                for s in range(self.pp):
                    made = new_group(self.dp_ranks(s))
                    dp_group = made if s == stage else dp_group
        return MeshGroups(self, replica, stage, pp_group, dp_group)


@dataclass(frozen=True)
class MeshGroups:
    """One rank's place in a mesh and its two sub-groups (None: the whole world)."""

    mesh: Mesh
    replica: int
    stage: int
    pp_group: object
    dp_group: object
