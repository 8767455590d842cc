"""What a parameter-server run is asked to do: staleness bound, backup workers, stragglers,
faults to inject, time limits. Checked once, here, so a bad value fails before any rank waits."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import MicroDDPError

SERVER = 0  # the parameter server's rank (the first of `servers`); the workers follow them


@dataclass
class PSConfig:
    """One run of the parameter server and its workers.

    `steps` counts global batches: the run ends at the update that brings the gradients applied
    (one shard each) to steps x workers, so sync, async and backup runs learn from the same
    number of samples, give or take the last update's (under SSP it applies all it holds).
    `staleness` is the bound S in versions (0 = synchronous, math.inf = fully asynchronous).
    """

    steps: int
    lr: float = 0.1
    momentum: float = 0.0
    staleness: float = 0
    backup_workers: int = 0
    staleness_lr: bool = False  # divide a gradient's step by its staleness (at least 1)
    stragglers: dict[int, float] = field(default_factory=dict)  # rank -> slowdown factor
    fail_after: dict[int, int] = field(default_factory=dict)  # rank -> gradients, then os._exit
    worker_timeout: float = 60.0  # a computing worker silent this long is dropped
    server_timeout: float = 60.0  # a worker waiting this long for the server gives up
    servers: int = 1  # ranks 0..servers-1 each hold one shard of the parameters

    def workers(self, world_size: int) -> list[int]:
        """The workers' ranks: every rank after the servers."""
        return list(range(self.servers, world_size))

    def check(self, world_size: int) -> None:
        """Raise MicroDDPError naming the first value that cannot run on `world_size` ranks."""
        if not isinstance(self.servers, int) or self.servers < 1:
            raise MicroDDPError(f"servers must be a whole number >= 1, got {self.servers!r}")
        workers = world_size - self.servers
        if workers < 1:
            raise MicroDDPError(f"a parameter-server run with {self.servers} server(s) needs "
                                f"at least {self.servers + 1} ranks (the servers + 1 worker), "
                                f"got {world_size}; start it with more ranks")
        if not isinstance(self.steps, int) or self.steps < 1:
            raise MicroDDPError(f"steps must be a whole number >= 1, got {self.steps!r}")
        if not (self.staleness >= 0 and (self.staleness == math.inf
                                         or float(self.staleness).is_integer())):
            raise MicroDDPError(f"staleness must be a whole number >= 0 or inf, got "
                                f"{self.staleness!r}")
        if not 0 <= self.backup_workers < workers:
            raise MicroDDPError(f"backup workers must be between 0 and {workers - 1} with "
                                f"{workers} workers (a step needs at least one gradient), got "
                                f"{self.backup_workers}")
        if self.backup_workers and self.staleness != 0:
            raise MicroDDPError("backup workers belong to synchronous training: use them with "
                                f"staleness 0, not {self.staleness:g}")
        for what, table in (("straggler", self.stragglers), ("fail_after", self.fail_after)):
            for rank in table:
                if not self.servers <= rank < world_size:
                    raise MicroDDPError(
                        f"{what} rank {rank} is not a worker: workers are ranks "
                        f"{self.servers}..{world_size - 1} ("
                        + ("rank 0 is the server)" if self.servers == 1 else
                           f"ranks 0..{self.servers - 1} are the servers)"))
        for rank, factor in self.stragglers.items():
            if not factor >= 1:
                raise MicroDDPError(f"straggler factor for rank {rank} must be >= 1 (how many "
                                    f"times slower), got {factor!r}")
        for name in ("worker_timeout", "server_timeout"):
            if not getattr(self, name) > 0:
                raise MicroDDPError(f"{name} must be positive seconds, got "
                                    f"{getattr(self, name)!r}")


def parse_straggler(text: str) -> dict[int, float]:
    """'RANK:FACTOR[,RANK:FACTOR...]' (as on a command line) -> {rank: factor}."""
    out: dict[int, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        rank, sep, factor = part.partition(":")
        try:
            if not sep:
                raise ValueError
            out[int(rank)] = float(factor)
            if not math.isfinite(out[int(rank)]):  # inf: a sleep no clock can hold
                raise ValueError
        except ValueError:
            raise MicroDDPError(f"straggler {part!r} is not RANK:FACTOR with a finite FACTOR "
                                "(e.g. 2:4 makes rank 2 four times slower)") from None
    return out


def parse_staleness(text: str) -> float:
    """'0', '3' or 'inf' -> the bound S."""
    if text.strip().lower() in ("inf", "infinity", "async"):
        return math.inf
    try:
        value = int(text)
    except ValueError:
        raise MicroDDPError(f"staleness {text!r} is neither a whole number >= 0 nor 'inf'") \
            from None
    if value < 0:
        raise MicroDDPError(f"staleness must be >= 0 (0 is synchronous), got {value}")
    return float(value)
