"""The ladder's stages as drop-in wrappers: same loop as with torch's DDP, different machinery.

`wrap(model, "hooks")` etc. build these; benchmarks and the training job use them to compare
stages side by side. Each one reuses the stage classes from `stages.py` unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .buckets import DEFAULT_BUCKET_CAP_MB
from .stages import BucketHooks, GradHooks, OverlapHooks, average_gradients
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
