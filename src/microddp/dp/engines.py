"""The engines: the one table of data-parallel wrappers and the one `wrap(model, engine)` that
builds them, the ladder's stages as drop-in wrappers (same loop as with torch's DDP, different
machinery), microddp's DistributedDataParallel and torch's.

`wrap(model, "hooks")` etc. build these; benchmarks and the training job use them to compare
stages side by side. Each one reuses the stage classes from `ladder.py` unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..comms import distributed
from ..errors import MicroDDPError
from .buckets import DEFAULT_BUCKET_CAP_MB
from .engine_names import ENGINES
from .ladder import BucketHooks, GradHooks, OverlapHooks, average_gradients
from .sync import broadcast_coalesced, sync_module_states


class AverageAfterBackward:
    """Stage 3 as a wrapper: the per-parameter all-reduces run once backward has finished."""

    def __init__(self, params) -> None:
        self.sync = True
        self.params = [p for p in params if p.requires_grad]
        self.handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params]
        self.queued = False

    def _hook(self, p: nn.Parameter) -> None:
        if self.sync and not self.queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self.queued = True

    def _finish(self) -> None:
        average_gradients(self.params)
        self.queued = False

    def remove(self) -> None:
        """Take the hook off the module, leaving it as it was."""
        for h in self.handles:
            h.remove()


STAGES = {"naive": AverageAfterBackward, "hooks": GradHooks, "buckets": BucketHooks,
          "overlap": OverlapHooks}


class StageDDP(nn.Module):
    """A model wrapped by one ladder stage: replicas start equal; backward leaves averaged grads."""

    def __init__(self, module: nn.Module, stage: str, bucket_cap_mb: float | None = None,
                 broadcast_buffers: bool = True) -> None:
        super().__init__()
        self.module = module
        self.stage = stage
        sync_module_states(module, buffers=broadcast_buffers)
        cap = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        kwargs = {"bucket_cap_mb": cap} if stage in ("buckets", "overlap") else {}
        self.reducer = STAGES[stage](module.parameters(), **kwargs)
        # As torch's DDP: rank 0's buffers (BatchNorm statistics) before each forward.
        self.buffers = list(module.buffers()) if broadcast_buffers else []

    def forward(self, *args, **kwargs):
        """Run the module, broadcasting its buffers from rank 0 first, as torch's DDP does."""
        if self.buffers:
            broadcast_coalesced(self.buffers, keep_versions=True)
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after the block averages them."""
        before = self.reducer.sync
        self.reducer.sync = False
        try:
            yield
        finally:
            self.reducer.sync = before


# Constructor arguments of torch's DistributedDataParallel that the ladder stages accept:
# bucket_cap_mb and broadcast_buffers do what torch's do; the others only at torch's default
# (the stages implement neither unused parameters nor static graphs nor bucket views).
_STAGE_KWARGS = {"bucket_cap_mb", "device_ids", "output_device", "broadcast_buffers",
                 "process_group", "find_unused_parameters", "gradient_as_bucket_view",
                 "static_graph"}
_STAGE_DEFAULT_ONLY = ("find_unused_parameters", "gradient_as_bucket_view", "static_graph")


def wrap(module: nn.Module, engine: str = "overlap", **ddp_kwargs) -> nn.Module:
    """Wrap `module` for data-parallel training with one of the ladder's engines.

    Every engine behaves like torch's DDP in a loop: replicas start from rank 0's parameters,
    `model(x)` then `loss.backward()` leaves gradients averaged over ranks, and the wrapper
    has `.module` and `.no_sync()`.
    """
    if engine not in ENGINES:
        raise MicroDDPError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    if engine == "microddp":
        from .ddp import DistributedDataParallel  # noqa: PLC0415 (ddp is the heaviest part)

        return DistributedDataParallel(module, **ddp_kwargs)
    if engine == "torch":
        return _torch_ddp(module, **ddp_kwargs)
    unknown = set(ddp_kwargs) - _STAGE_KWARGS
    if unknown:
        raise MicroDDPError(f"engine {engine!r} does not take {', '.join(sorted(unknown))}; "
                            f"it accepts {', '.join(sorted(_STAGE_KWARGS))}")
    if ddp_kwargs.get("process_group") is not None:
        raise MicroDDPError(f"engine {engine!r} runs on the default group only; "
                            "use engine='microddp' for a process_group")
    for name in _STAGE_DEFAULT_ONLY:
        if ddp_kwargs.get(name):
            raise MicroDDPError(f"engine {engine!r} does not implement {name}=True; "
                                "use engine='microddp' (or 'torch') for it")
    return StageDDP(module, engine, ddp_kwargs.get("bucket_cap_mb"),
                    ddp_kwargs.get("broadcast_buffers", True) is not False)


def _torch_ddp(module: nn.Module, **kwargs) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    if not distributed():
        raise MicroDDPError("engine 'torch' needs a process group; start several ranks "
                            "(microddp run -n 2 ...) or pick another engine for one process")
    return DistributedDataParallel(module, **kwargs)
