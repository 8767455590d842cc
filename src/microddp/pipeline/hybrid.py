"""Hybrid DP x PP: a rank's pipeline stages, each replicated over its data-parallel group
with microddp's DDP, gradients averaged once per optimizer step.

A schedule runs many backwards per step (one per micro-batch, or an I and a W each). Under
DDP's usual rule each would average its gradients, m times the traffic, and partial sums at
that. So the schedule runs inside `no_sync()`, where the micro-batches' gradients only add up
in `.grad`, and `average()` then averages the sums once: through DDP's own reducer (its
buckets, its overlap of copies and all-reduces), by a syncing forward and backward of an empty
batch, which adds exactly zero to every gradient.

    stages = Replicated({s: cut[s] for s in mine}, dp_group, replicas)
    with stages.no_sync():
        pipeline.run_schedule(schedule, stages.modules, x, y, loss_fn, group=pp_group)
    stages.average()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from ..dp import DistributedDataParallel


class Replicated:
    """`stages` ({stage index: module}, each starting with an nn.Linear) replicated over
    `group`, a group of `replicas` ranks (None: the whole world). With one replica nothing is
    wrapped and nothing is averaged."""

    def __init__(self, stages: dict[int, nn.Module], group, replicas: int) -> None:
        self.stages = stages
        self.ddp = ({s: DistributedDataParallel(m, process_group=group)
                     for s, m in stages.items()} if replicas > 1 else {})
        # what run_schedule runs: the DDP wrapper where there is one
        self.modules: dict[int, nn.Module] = {s: self.ddp.get(s, m) for s, m in stages.items()}

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients accumulate locally, with no communication, until the block ends."""
        with contextlib.ExitStack() as stack:
            for ddp in self.ddp.values():
                stack.enter_context(ddp.no_sync())
            yield

    def average(self) -> None:
        """Average every stage's accumulated gradients over its replicas, once."""
        for s, ddp in self.ddp.items():
            first = next(m for m in self.stages[s].modules() if isinstance(m, nn.Linear))
            param = next(ddp.parameters())
            ddp(param.new_zeros(0, first.in_features)).sum().backward()
