"""The strategies the training job can run, one file each, found through one table
(registry.py): `check(cfg, n)` runs the named strategy's own checks of its settings,
`make(cfg, world, module, precision)` builds its part in the training loop (strategies/base.py's
interface), and `implementation(name)` is its file, for a strategy that runs a job of its
own (`--strategy async`: parameter_server.py's `train`).

dp.py (a replica per rank), pipeline.py (pp, dp-pp), zero.py (zero1, zero2, zero3),
parameter_server.py (async). Nothing is imported until a strategy is asked for: the table
itself needs no torch (`microddp train --help` reads it).
"""

from __future__ import annotations

from importlib import import_module
from types import ModuleType
from typing import TYPE_CHECKING

from ...errors import MicroDDPError
from .registry import PIPELINES, REGISTRY, STRATEGIES, Entry

if TYPE_CHECKING:
    from torch import nn

    from ...world.world import World
    from ..build import Precision
    from ..config import TrainConfig
    from .base import Strategy


def entry(name: str) -> Entry:
    """The table's line for `--strategy name`, or one clear error naming the choices."""
    if name not in REGISTRY:
        raise MicroDDPError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
    return REGISTRY[name]


def implementation(name: str) -> ModuleType:
    """The file of this folder that implements `--strategy name`."""
    return import_module(f"{__name__}.{entry(name).module}")


def check(cfg: TrainConfig, n: int) -> None:
    """The named strategy's own checks of `cfg` on `n` ranks (MicroDDPError on the first)."""
    implementation(cfg.strategy).check(cfg, n)


def make(cfg: TrainConfig, world: World, module: nn.Module, precision: Precision) -> Strategy:
    """This rank's part of strategy `cfg.strategy` around `module` (built on every rank)."""
    impl = implementation(cfg.strategy)
    if entry(cfg.strategy).own_loop:
        raise MicroDDPError(f"--strategy {cfg.strategy} runs a job of its own, not the "
                            "synchronous training loop")
    return impl.make(cfg, world, module, precision)


__all__ = ["PIPELINES", "REGISTRY", "STRATEGIES", "Entry", "check", "entry", "implementation",
           "make"]
