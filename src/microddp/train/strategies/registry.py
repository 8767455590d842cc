"""Every `--strategy` the training job knows, in one table: a name, the file of this folder
that implements it, and what the job must know about it before any rank starts.

A new strategy is one new file in this folder (a `check(cfg, n)` of its own settings, and
either `make(cfg, world, module, precision)`, its part in the training loop, or `train(world,
cfg, on_step)`, a job of its own) plus one line below. This module imports nothing, not even
torch: `microddp train --help` lists the names from here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    """What one `--strategy` name is."""

    module: str             # its file in train/strategies/ (without .py)
    pipeline: bool = False  # cuts the model into --pp stages (--pp, --microbatches, --schedule)
    own_loop: bool = False  # runs a job of its own (`train`), not the synchronous loop (`make`)
    expendable: bool = False  # ranks 1.. may fail while the run goes on (a server's workers)
    replicas: bool = False  # a whole replica of the model on every rank (what --drift-every compares)


REGISTRY = {
    "dp": Entry("dp", replicas=True),
    "pp": Entry("pipeline", pipeline=True),
    "dp-pp": Entry("pipeline", pipeline=True),
    "zero1": Entry("zero", replicas=True),
    "zero2": Entry("zero", replicas=True),
    "zero3": Entry("zero"),
    "async": Entry("parameter_server", own_loop=True, expendable=True),
}
STRATEGIES = tuple(REGISTRY)
PIPELINES = tuple(name for name, entry in REGISTRY.items() if entry.pipeline)
