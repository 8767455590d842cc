"""Cut a FullMLP into consecutive stages, one slice of its layers per stage.

FullMLP is `depth` blocks of Linear+ReLU and a Linear head. A stage gets whole blocks (a
Linear is never parted from its ReLU), the head rides with the last stage, and when the
blocks do not divide evenly the first stages take one more: the last stage already carries
the head, so this keeps the stages closest to equal. The stage modules share their
parameters with the model they were cut from, so the model's state_dict sees every update.
"""

from __future__ import annotations

from torch import nn

from ..errors import MicroDDPError
from ..model import FullMLP


def blocks_per_stage(depth: int, stages: int) -> list[int]:
    """How many Linear+ReLU blocks each of `stages` stages gets: equal, the first ones +1."""
    if not isinstance(stages, int) or stages < 1:
        raise MicroDDPError(f"a pipeline needs at least 1 stage, got {stages!r}")
    if depth < stages:
        raise MicroDDPError(
            f"cannot cut a FullMLP of depth {depth} into {stages} stages: every stage needs at "
            f"least one Linear+ReLU block; use at most {depth} stages (ranks x virtual stages) "
            "or a deeper model")
    base, extra = divmod(depth, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


def stage_bounds(depth: int, stages: int) -> list[tuple[int, int]]:
    """For each stage, the [start, stop) range of its modules in `FullMLP.net`."""
    bounds, start = [], 0
    for s, n in enumerate(blocks_per_stage(depth, stages)):
        stop = start + 2 * n + (1 if s == stages - 1 else 0)  # the head joins the last stage
        bounds.append((start, stop))
        start = stop
    return bounds


def split_model(model: FullMLP, stages: int) -> list[nn.Sequential]:
    """The stages of `model`, in order: slices of `model.net` that share its parameters.

    Running them one after the other is running the model: no layer is dropped or repeated.
    """
    if not isinstance(model, FullMLP):
        raise MicroDDPError(f"split_model cuts a microddp FullMLP, got {type(model).__name__}; "
                            "build the model with microddp.FullMLP(dim, depth)")
    return [model.net[a:b] for a, b in stage_bounds(model.depth, stages)]


def stage_parameter_names(model: FullMLP, stages: int, stage: int) -> list[str]:
    """The names in `model.state_dict()` of the parameters that stage `stage` holds."""
    a, b = stage_bounds(model.depth, stages)[stage]
    return [f"net.{i}.{name}" for i in range(a, b)
            for name, _ in model.net[i].named_parameters()]
