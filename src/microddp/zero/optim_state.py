"""ZeroRedundancyOptimizer's state in torch's consolidated layout, gathered from and cut into
the shards.

Each rank's inner optimizer holds, per bucket, state over the rank's elements of the bucket:
1-D tensors (Adam's moments, SGD's momentum) cut like the parameters, and per-shard scalars
(Adam's `step`, the same on every rank). torch's consolidated state dict holds, per global
parameter index (every group's parameters in order, frozen ones included), tensors of the
parameter's shape. Consolidating gathers each bucket's 1-D state with the same collectives the
parameters travel by (comm.broadcast_shards), one bucket and one name at a time, and rank `to`
cuts it into the parameters' shapes; loading takes each rank's elements back out (flat.take_own).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import MicroDDPError
from .comm import Sent, broadcast_shards
from .flat import take_own


def _elementwise(name: str, value: Any) -> bool:
    """A shard's state tensor over its elements (cut like the parameters), as opposed to a
    scalar such as `step`."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and name != "step"


def _global_index(opt) -> dict[int, int]:
    """id(parameter) -> its index in torch's state dict (every group's parameters in order)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    return {id(p): i for i, p in enumerate(params)}


def consolidate(opt, to: int) -> dict[int, dict[str, Any]] | None:
    """The whole state by global parameter index, on group rank `to`; None on the others."""
    index, mine, out = _global_index(opt), opt.rank == to, {}
    unsent = Sent()  # checkpointing is not a training step's traffic
    for group in opt._groups:
        for b, shard in zip(group.plan.buckets, group.shards, strict=True):
            state = opt.optim.state.get(shard, {})
            for name in sorted(state):
                value = state[name]
                if _elementwise(name, value):
                    flat = value.new_empty(b.numel)
                    flat.narrow(0, b.start(opt.rank), b.sizes[opt.rank]).copy_(value)
                    for handle in broadcast_shards(b, flat, opt.rank, unsent,
                                                   opt.process_group):
                        handle.wait()
                    full, at = flat.cpu(), 0
                    for i, n in zip(b.params, b.numels, strict=True):
                        if mine:
                            p = group.params[i]
                            out.setdefault(index[id(p)], {})[name] = \
                                full.narrow(0, at, n).view_as(p).clone()
                        at += n
                elif mine:
                    for i in b.params:
                        copy = value.detach().clone() if isinstance(value, torch.Tensor) else value
                        out.setdefault(index[id(group.params[i])], {})[name] = copy
    return dict(sorted(out.items())) if mine else None


def load_shards(opt, state: dict) -> None:
    """Set every shard's inner-optimizer state from torch's consolidated `state` (keys: global
    parameter indices, as ints or as the strings a JSON round trip makes of them)."""
    index = _global_index(opt)
    state = {int(k): v for k, v in state.items()}
    opt.optim.state.clear()
    for group in opt._groups:
        for b, shard in zip(group.plan.buckets, group.shards, strict=True):
            per_param = [state.get(index[id(group.params[i])]) for i in b.params]
            # A parameter with no elements owns no state worth keeping (torch may keep none)
            present = [s for s, n in zip(per_param, b.numels, strict=True) if s is not None or n]
            if all(s is None for s in present):
                continue
            if any(s is None for s in present):
                raise MicroDDPError(
                    "the state dict has optimizer state for some parameters of a bucket and "
                    "not for others; load it into an optimizer built with "
                    "parameters_as_bucket_view=False (one parameter per bucket)")
            first = next(s for s in present if s is not None)
            loaded = {}
            for name, value in first.items():
                if isinstance(value, torch.Tensor) and name != "step" and value.dim() > 0:
                    own = shard.new_empty(shard.shape)
                    tensors = [None] * len(group.params)
                    for i, s in zip(b.params, per_param, strict=True):
                        tensors[i] = (s[name].to(shard.device, shard.dtype) if s is not None
                                      else group.params[i].new_zeros(group.params[i].shape))
                    take_own(b, opt.rank, tensors, own)
                    loaded[name] = own
                else:
                    loaded[name] = value.clone() if isinstance(value, torch.Tensor) else value
            opt.optim.state[shard] = loaded
