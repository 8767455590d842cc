"""What `--elastic` takes and what it refuses, checked before any rank starts (no torch here:
`microddp train` checks its flags before loading it)."""

from __future__ import annotations

import math

from ..errors import MicroDDPError
from .config import TrainConfig


def check(cfg: TrainConfig, world_size: int | None = None) -> None:
    """One line for each thing --elastic is not built for (train/elastic.py says why)."""
    if cfg.strategy != "dp":
        raise MicroDDPError(f"--elastic works with --strategy dp only (not built for "
                            f"{cfg.strategy}: ZeRO would have to rebuild the lost rank's "
                            "optimizer shards, a pipeline its stage); drop --elastic")
    for flag, bad in (("--tp", cfg.tp > 1), ("--pp", (cfg.pp or 1) > 1),
                      ("--cp", getattr(cfg, "cp", 1) > 1), ("--accumulate", cfg.accumulate > 1),
                      ("--amp", cfg.amp is not None), ("--resume", cfg.resume),
                      ("--model gpt", cfg.model != "mlp"), ("--trace", cfg.trace),
                      ("--straggler", bool(cfg.straggler)),
                      ("--engine", cfg.engine != "microddp"),
                      ("--max-restarts", cfg.max_restarts > 0)):
        if bad:
            raise MicroDDPError(f"--elastic does not take {flag} yet (it averages one flat "
                                "gradient over gloo per step); drop one of them")
    if cfg.replacements < 0:
        raise MicroDDPError(f"--replacements must be 0 or more, got {cfg.replacements}")
    n = cfg.nproc if world_size is None else world_size
    if not 1 <= cfg.min_ranks <= n:
        raise MicroDDPError(f"--min-ranks must be between 1 and the {n} ranks, got "
                            f"{cfg.min_ranks}")
    if not (math.isfinite(cfg.elastic_timeout) and cfg.elastic_timeout > 0):
        raise MicroDDPError(f"--elastic-timeout must be a positive number of seconds, got "
                            f"{cfg.elastic_timeout}")
