"""The strategies the training job can run, one file each, all behind strategies/base.py's
interface: `make(cfg, world, module, precision)` builds the one `--strategy` names.

dp.py (a replica per rank), pipeline.py (pp, dp-pp), zero.py (zero1, zero2, zero3).
"""

from __future__ import annotations

from torch import nn

from ...errors import MicroDDPError
from ...world.world import World
from ..build import Precision
from ..config import TrainConfig
from .base import Strategy


def make(cfg: TrainConfig, world: World, module: nn.Module, precision: Precision) -> Strategy:
    """This rank's part of strategy `cfg.strategy` around `module` (built on every rank)."""
    if cfg.strategy == "dp":
        from .dp import DataParallel

        return DataParallel(cfg, world, module, precision)
    if cfg.strategy in ("pp", "dp-pp"):
        from .pipeline import Pipeline

        return Pipeline(cfg, world, module, precision)
    if cfg.strategy in ("zero1", "zero2", "zero3"):
        from .zero import Sharded

        return Sharded(cfg, world, module, precision)
    raise MicroDDPError(f"--strategy {cfg.strategy} has no procedure in the training loop; "
                        "choose dp, pp, dp-pp, zero1, zero2 or zero3")


__all__ = ["Strategy", "make"]
