"""This rank's shard of the parameters, and the optimizer that steps only that shard.

One shard parameter per bucket: the rank's elements of the bucket (`sizes[rank]` of them). In
stages 1 and 2 it is a view of the bucket's flat parameter buffer, which the module's
parameters are views of too: the optimizer updates the rank's elements in place, where the
broadcast of them starts from, with no copy back and no second copy of them held. In stage 3
the flat buffers are emptied between uses, so the shard has its own storage. The user's
optimizer class is built over the shard parameters, each parameter group with its buckets'
shards and its own options (lr, weight decay, ...), so any torch.optim optimizer whose update
is element-wise (SGD, Adam, AdamW, ...) gives the same numbers as on the full parameters, and
its state (Adam's two moments) exists for 1/N of the elements only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import MicroDDPError
from .flat import take_own
from .plan import Bucket, ShardPlan


def trainable_groups(module: nn.Module, param_groups: Iterable[Any] | None
                     ) -> tuple[list[nn.Parameter], list[int], list[dict]]:
    """The parameters to shard (those that require grad), the group of each, and each group's
    options without its parameters. Parameters that are frozen are left out: they are never
    stepped, so they need neither gradients nor optimizer state."""
    if param_groups is None:
        param_groups = [{"params": list(module.parameters())}]
    groups = list(param_groups)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    owned = {id(p): name for name, p in module.named_parameters()}
    params, group_of, options, seen = [], [], [], set()
    for g, group in enumerate(groups):
        group_params = group["params"]
        group_params = [group_params] if isinstance(group_params, torch.Tensor) else list(group_params)
        for p in group_params:
            if id(p) not in owned:
                raise MicroDDPError(f"parameter group {g} holds a tensor of shape "
                                    f"{tuple(p.shape)} that is not a parameter of the module; "
                                    "ZeRO shards the module's own parameters: pass those")
            if id(p) in seen:
                raise MicroDDPError(f"parameter {owned[id(p)]!r} appears in two parameter "
                                    "groups; put each parameter in one group")
            seen.add(id(p))
            if p.requires_grad:
                params.append(p)
                group_of.append(g)
        options.append({k: v for k, v in group.items() if k != "params"})
    missing = [name for name, p in module.named_parameters() if p.requires_grad
               and id(p) not in seen]
    if missing:
        raise MicroDDPError(f"parameters {missing} require grad but are in no parameter group; "
                            "add them to a group, or set requires_grad=False to freeze them")
    return params, group_of, options


def shard_views(plan: ShardPlan, flats: Sequence[torch.Tensor], rank: int) -> list[nn.Parameter]:
    """This rank's shard of each bucket as a parameter viewing its part of the bucket's flat
    buffer (`flats[i]`: bucket i's parameters end to end): an optimizer stepping the shards
    updates the parameters in place, and a broadcast of every rank's part completes them.
    The one cut of optimizer state by elements: Zero's stages 1 and 2 and
    ZeroRedundancyOptimizer both shard through it."""
    return [nn.Parameter(flat.narrow(0, b.start(rank), b.sizes[rank]))
            for b, flat in zip(plan.buckets, flats, strict=True)]


class Shards:
    """This rank's shard parameters (one per bucket) and the inner optimizer over them."""

    def __init__(self, plan: ShardPlan, rank: int, params: Sequence[torch.Tensor],
                 options: Sequence[dict], optimizer_class: type, defaults: dict,
                 flats: Sequence[torch.Tensor] | None = None) -> None:
        """`flats` (stages 1 and 2): each bucket's flat parameter buffer, which the shards
        become views of; without them (stage 3) each shard is a copy of the rank's elements."""
        self.plan, self.rank = plan, rank
        like = params[0] if params else torch.empty(0)
        if flats is not None:
            self.params = shard_views(plan, flats, rank)
        else:
            self.params = []
            for b in plan.buckets:
                own = torch.empty(b.sizes[rank], dtype=like.dtype, device=like.device)
                take_own(b, rank, params, own)
                self.params.append(nn.Parameter(own))  # shares `own`'s memory
        groups = [{**opts, "params": [self.params[b.index] for b in plan.buckets
                                      if b.group == g]} for g, opts in enumerate(options)]
        try:
            self.optimizer = optimizer_class(groups, **defaults)
        except (TypeError, ValueError) as e:
            raise MicroDDPError(f"could not build {getattr(optimizer_class, '__name__', optimizer_class)}"
                                f" over the shards: {e}; pass a torch.optim optimizer class and "
                                "its options, e.g. zero.Zero(model, torch.optim.Adam, lr=1e-3)"
                                ) from e

    def view(self, bucket: Bucket) -> torch.Tensor:
        """This rank's elements of `bucket`: its shard parameter's data."""
        return self.params[bucket.index].data

    def grad_target(self, bucket: Bucket, replace: bool) -> tuple[torch.Tensor, bool]:
        """Where this rank's reduced part of `bucket` should land, and whether it must be
        added to the shard gradient afterwards. The shard gradient itself when there is none
        yet or when it is replaced (ZeRO-1, whose reduction is of the full gradient
        accumulated since zero_grad): the reduction writes it directly, no copy. Else (a
        second synchronized backward before zero_grad) a new tensor, added after the wait."""
        shard = self.params[bucket.index]
        if shard.grad is None:
            shard.grad = torch.empty_like(shard)
            return shard.grad, False
        if replace:
            return shard.grad, False
        return torch.empty_like(shard), True

    def add_grad(self, bucket: Bucket, reduced: torch.Tensor) -> None:
        """Accumulate a bucket's averaged part (this rank's `sizes[rank]` elements) into this
        rank's shard gradient."""
        self.params[bucket.index].grad.add_(reduced)

    def put_own(self, bucket: Bucket, flat: torch.Tensor) -> None:
        """Copy this rank's elements of `bucket` into `flat` (the bucket's parameters end to
        end), where the broadcast of them starts from (stage 3: in stages 1 and 2 they are
        there already)."""
        flat.narrow(0, bucket.start(self.rank), bucket.sizes[self.rank]).copy_(self.view(bucket))

    def zero_grad(self) -> None:
        """Drop the shards' gradients (set to None, as torch's optimizers do)."""
        for shard in self.params:
            shard.grad = None
