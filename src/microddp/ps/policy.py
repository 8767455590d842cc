"""Bounded staleness (stale synchronous parallel) as pure bookkeeping, no communication, so the
rule can be tested on any order of arrivals.

The server's version v counts its updates. A worker computes on the parameters of the version
it was last sent (q). A gradient computed on version p and applied while the server is at
version v has staleness v - p. The rule keeps every applied staleness <= S:

- gradients that arrive are *held*, and their workers wait for new parameters;
- the held gradients are applied together, as one averaged update, only when that update would
  leave every worker still computing within the bound (v + 1 - q <= S);
- so S = 0 waits for every worker: one update per step, the average of all its gradients, which
  is synchronous SGD; S = inf applies each gradient as it arrives: fully asynchronous SGD.

With backup workers (S = 0 only) the update goes as soon as N - b gradients are held; a late
gradient is then one version old and is discarded, and its worker gets the new parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class Held:
    """A gradient received and not yet applied: who sent it, from which version."""

    worker: int
    version: int
    grad: torch.Tensor
    samples: int
    loss: float = 0.0  # the shard's summed loss at the parameters it was computed on


@dataclass
class Staleness:
    """The server's side of SSP: version, who computes on what, what is held."""

    bound: float
    backup_workers: int = 0
    version: int = 0
    shards: int = 0  # parts a global batch is cut into (the workers at the start); 0: no scaling
    computing: dict[int, int] = field(default_factory=dict)  # worker -> version it computes on
    held: list[Held] = field(default_factory=list)

    def sent(self, worker: int) -> None:
        """`worker` was just sent the current parameters and computes on them."""
        self.computing[worker] = self.version

    def arrived(self, g: Held) -> bool:
        """Record a gradient; False if it is too stale to apply (it is then dropped and its
        worker must be sent fresh parameters), True if it is held for the next update."""
        self.computing.pop(g.worker, None)
        if self.version - g.version > self.bound:
            return False
        self.held.append(g)
        return True

    def lost(self, worker: int) -> None:
        """`worker` is gone: stop waiting for it (a gradient it already sent stays held)."""
        self.computing.pop(worker, None)

    def may_update(self, live_workers: int) -> bool:
        """Whether the held gradients can be applied now without breaking the bound."""
        if not self.held:
            return False
        if self.backup_workers and len(self.held) >= max(1, live_workers - self.backup_workers):
            return True
        return all(self.version + 1 - q <= self.bound for q in self.computing.values())

    def take(self, staleness_lr: bool = False, out: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, list[Held], list[int]]:
        """The update to apply now, the gradients used and their staleness; v advances.

        S = 0: the mean of the held gradients, one global batch's gradient. S > 0: each held
        gradient counts as its shard's share of a global batch (divided by `shards`, not by how
        many are held), so a global batch's worth of updates moves the parameters as far as one
        synchronous step; otherwise N workers' updates take N full steps per global batch.
        With `staleness_lr` each gradient is also divided by its staleness (at least 1).
        `out`: the tensor to write the update into (the server's flat gradient buffer)."""
        # In worker order, not arrival order: float addition is not associative, and this way
        # the same gradients always sum to the same bits (S=0 is deterministic, run after run).
        used, self.held = sorted(self.held, key=lambda g: g.worker), []
        stale = [self.version - g.version for g in used]
        weights = [1.0 / max(1, s) if staleness_lr else 1.0 for s in stale]
        share = len(used) if self.bound == 0 or not self.shards else self.shards
        total = torch.empty_like(used[0].grad) if out is None else out
        torch.mul(used[0].grad, weights[0], out=total)
        for w, g in zip(weights[1:], used[1:], strict=True):
            total.add_(g.grad, alpha=w)
        self.version += 1
        return total.div_(share), used, stale


def is_sync(bound: float) -> bool:
    """S = 0: every step waits for every worker."""
    return bound == 0


def describe(bound: float, backup_workers: int = 0) -> str:
    """A short name for a run's consistency model, for tables."""
    if bound == 0:
        return f"sync, {backup_workers} backup" if backup_workers else "sync (S=0)"
    return "async (S=inf)" if bound == math.inf else f"SSP S={bound:g}"
