"""`ZeroRedundancyOptimizer`: ZeRO-1 in the shape of torch's, an optimizer to pair with any DDP.

    opt = zero.ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
    loss_fn(ddp(x), y).backward(); opt.step(); opt.zero_grad()

torch.distributed.optim.ZeroRedundancyOptimizer's constructor, methods and state-dict format:
DDP averages the gradients into `.grad`, each rank steps its shard of every parameter group with
an inner `optimizer_class`, and the updated elements are broadcast back into every rank's
parameters. One difference inside: torch hands out whole parameters (sorted-greedy), this one
cuts every bucket by elements (plan.py), so the state is balanced to one element whatever the
parameter sizes; the price is that the inner optimizer must be element-wise (SGD, Adam, AdamW,
...; LBFGS and friends are refused). `parameters_as_bucket_view=True` lays each group's
parameters end to end in flat buffers (few, large collectives); False (torch's default) keeps
every parameter's own storage and shards each parameter alone. The consolidated state dict
(optim_state.py) has torch's layout: full-shaped state per global parameter index.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import comms
from ..dp.buckets import DEFAULT_BUCKET_CAP_MB, MiB
from ..errors import MicroDDPError
from .comm import Sent, broadcast_shards
from .flat import flat_views, take_own
from .optim_state import consolidate, load_shards
from .plan import build, by_size
from .shards import shard_views

# Their update of an element depends on other elements (a line search, factored or
# orthogonalised statistics, sparse rows), so a shard cut by elements cannot be stepped alone.
NOT_ELEMENT_WISE = ("LBFGS", "SparseAdam", "Adafactor", "Muon")


class ParamsTypeError(MicroDDPError, TypeError):
    """`params` is not what torch's optimizers take (a TypeError, as torch raises)."""


class ParamsValueError(MicroDDPError, ValueError):
    """`params` is empty or mixes dense types (a ValueError, as torch raises)."""


class _Group:
    """One parameter group's sharding: its trainable parameters, their plan over the ranks,
    the flat buffer of each bucket (the parameters are views of it) and this rank's shard of
    each bucket (a view of its part of the flat buffer, which the inner optimizer steps)."""

    def __init__(self, params: list[torch.Tensor], as_bucket_view: bool, world_size: int,
                 rank: int) -> None:
        self.params = [p for p in params if p.requires_grad]
        numels = [p.numel() for p in self.params]
        zeros = [0] * len(numels)
        if as_bucket_view:
            cap = int(DEFAULT_BUCKET_CAP_MB * MiB) // max(1, _element_size(self.params))
            bucket_params = by_size(numels, zeros, cap)
        else:
            bucket_params = [[i] for i in range(len(numels))]
        self.plan = build(numels, zeros, bucket_params, world_size)
        self.rank = rank
        self.flats: list[torch.Tensor] = []
        for b in self.plan.buckets:
            one = self.params[b.params[0]] if len(b.params) == 1 else None
            # One parameter alone: its own storage is the flat buffer (torch's default leaves
            # every parameter's storage as it is); else one buffer the parameters view.
            self.flats.append(one.detach().view(-1) if one is not None and one.is_contiguous()
                              else flat_views(b, self.params))
        self.shards = shard_views(self.plan, self.flats, rank)

    def set_grads(self) -> None:
        """Each shard's gradient: this rank's elements of its bucket's `.grad`s (a view when
        the bucket is one parameter)."""
        for b, shard in zip(self.plan.buckets, self.shards, strict=True):
            grads = [self.params[i].grad for i in b.params]
            if all(g is None for g in grads):
                shard.grad = None  # as torch: a parameter with no gradient is not stepped
                continue
            if any(g is None for g in grads):
                raise MicroDDPError(
                    "some parameters of a bucket have a gradient and others none: stepping "
                    "the bucket would update those with none; build the optimizer with "
                    "parameters_as_bucket_view=False (each parameter stepped alone)")
            if any(g.is_sparse for g in grads):
                raise MicroDDPError("ZeroRedundancyOptimizer shards dense gradients only; "
                                    "use a dense embedding (sparse=False)")
            g = grads[0]
            if len(grads) == 1 and g.is_contiguous():
                shard.grad = g.view(-1).narrow(0, b.start(self.rank), b.sizes[self.rank])
            else:
                shard.grad = shard.new_empty(shard.shape)
                take_own(b, self.rank, [p.grad for p in self.params], shard.grad)

    def clear_grads(self) -> None:
        for shard in self.shards:
            shard.grad = None


def _element_size(params: list[torch.Tensor]) -> int:
    return params[0].element_size() if params else 4


def _sync_options(src: list[dict], dst: list[dict]) -> None:
    """Copy every option but the parameters from each group of `src` to `dst`'s (lr set by a
    scheduler on the outer groups, keys an inner optimizer adds to its own)."""
    for s, d in zip(src, dst, strict=True):
        for k, v in s.items():
            if k != "params":
                d[k] = v


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """torch's ZeroRedundancyOptimizer: `optimizer_class(**defaults)` steps this rank's shard
    of `params` (tensors or parameter groups), after a DDP (microddp's or torch's) averaged
    the gradients. `process_group`: the ranks to shard over (the world's by default)."""

    def __init__(self, params: Any, optimizer_class: type, process_group: Any = None,
                 parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False,
                 **defaults: Any) -> None:
        params = _checked(params)
        if overlap_with_ddp:
            raise MicroDDPError(
                "overlap_with_ddp=True is not supported: microddp's ZeRO-1 steps after backward; "
                "for a step that overlaps backward use zero.Zero(module, cls, stage=1), whose "
                "reduce-scatter runs during backward")
        name = getattr(optimizer_class, "__name__", repr(optimizer_class))
        if not isinstance(optimizer_class, type) or not issubclass(optimizer_class,
                                                                   torch.optim.Optimizer):
            raise MicroDDPError(f"optimizer_class must be a torch.optim.Optimizer class, got "
                                f"{name}; e.g. optimizer_class=torch.optim.Adam")
        if any(c.__name__ in NOT_ELEMENT_WISE for c in optimizer_class.__mro__):
            raise MicroDDPError(
                f"{name} updates an element from others (not element-wise), so it cannot step "
                "a shard cut by elements; use SGD, Adam, AdamW or another element-wise "
                "optimizer, or torch.distributed.optim.ZeroRedundancyOptimizer (whole "
                "parameters per rank)")
        self._initialized = False
        super().__init__(params, defaults)
        self.process_group = process_group
        self.world_size = comms.group_size(process_group)
        self.rank = comms.group_rank(process_group)
        if self.rank < 0:
            raise MicroDDPError("this rank is not in process_group; build the optimizer only "
                                "on the group's ranks")
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self._optimizer_class, self._defaults = optimizer_class, defaults
        self.sent = Sent()
        self._groups = [self._shard(g) for g in self.param_groups]
        self._trainable = self._trainable_mask()
        try:
            self.optim = optimizer_class(
                [{**_options(g), "params": s.shards}
                 for g, s in zip(self.param_groups, self._groups, strict=True)], **defaults)
        except (TypeError, ValueError) as e:
            raise MicroDDPError(f"could not build {name} over the shards: {e}") from e
        _sync_options(self.optim.param_groups, self.param_groups)
        self._consolidated: dict | None = None
        self._initialized = True

    def _shard(self, group: dict) -> _Group:
        return _Group(group["params"], self.parameters_as_bucket_view, self.world_size,
                      self.rank)

    def _trainable_mask(self) -> list[bool]:
        return [p.requires_grad for g in self.param_groups for p in g["params"]]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (on every rank: its shards are cut now), stepped from the next step."""
        super().add_param_group(param_group)
        if not self._initialized:
            return  # the constructor's own groups, sharded once it has the process group
        group = self._shard(self.param_groups[-1])
        self._groups.append(group)
        self.optim.add_param_group({**_options(self.param_groups[-1]), "params": group.shards})
        _sync_options(self.optim.param_groups, self.param_groups)
        self._trainable = self._trainable_mask()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Run `closure` (with grad, as torch's optimizers do) if given, step this rank's
        shards with the averaged `.grad`s, then broadcast every rank's updated elements into
        the parameters. Returns the closure's loss. Extra keyword arguments go to the inner
        optimizer's step."""
        loss = None
        if callable(closure):
            with torch.enable_grad():
                loss = closure()
        if self._trainable_mask() != self._trainable:
            raise MicroDDPError(
                "a parameter's requires_grad changed since the optimizer was built (its shards "
                "are cut over the trainable ones); build a new ZeroRedundancyOptimizer, or keep "
                "trainability fixed and use lr=0 for a group to freeze it")
        _sync_options(self.param_groups, self.optim.param_groups)
        for group in self._groups:
            group.set_grads()
        try:
            self.optim.step(**kwargs)
        finally:
            for group in self._groups:
                group.clear_grads()
        _sync_options(self.optim.param_groups, self.param_groups)
        self._broadcast()
        return loss

    def _broadcast(self) -> None:
        """Every rank's updated elements into every rank's parameters: all the broadcasts
        start before the first wait, so they travel together."""
        handles = []
        for group in self._groups:
            for b, flat in zip(group.plan.buckets, group.flats, strict=True):
                if b.numel:
                    handles += broadcast_shards(b, flat, self.rank, self.sent,
                                                self.process_group)
        for handle in handles:
            handle.wait()
        self.sent.end_step()

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole optimizer state on rank `to` (its rank in the process group), for
        state_dict(); every rank must call it. Gathered bucket by bucket as tensors: no pickled
        objects, at most one bucket's state in flight."""
        _sync_options(self.param_groups, self.optim.param_groups)
        self._consolidated = consolidate(self, to)

    def state_dict(self) -> dict[str, Any]:
        """torch's format: {"state": {index: {name: full-shaped value}}, "param_groups": [...]},
        indices over every group's parameters in order; on the rank consolidate_state_dict
        gathered to."""
        if self._consolidated is None:
            raise MicroDDPError("the optimizer state has not been consolidated on this rank; "
                                f"call consolidate_state_dict(to={self.rank}) on every rank "
                                "first")
        index, groups = 0, []
        for g in self.param_groups:
            groups.append({**_options(g), "params": list(range(index, index + len(g["params"])))})
            index += len(g["params"])
        return {"state": dict(self._consolidated), "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a consolidated state dict (every rank the whole of it): each rank keeps its
        elements of every state tensor, and every group's options."""
        saved = state_dict.get("param_groups")
        if not isinstance(saved, list) or len(saved) != len(self.param_groups) or any(
                len(s["params"]) != len(g["params"]) for s, g in zip(saved, self.param_groups, strict=True)):
            raise MicroDDPError("the state dict's parameter groups do not match this "
                                "optimizer's (number of groups or of parameters per group); "
                                "load the state of an optimizer built over the same parameters")
        for s, g in zip(saved, self.param_groups, strict=True):
            g.update(_options(s))
        _sync_options(self.param_groups, self.optim.param_groups)
        load_shards(self, state_dict["state"])
        self._consolidated = None


def _options(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def _checked(params: Any) -> list:
    """`params` as a list, checked as torch's ZeroRedundancyOptimizer checks it (the same
    exception types)."""
    if isinstance(params, torch.Tensor):
        raise ParamsTypeError(f"params must be an iterable of tensors or dicts, got a "
                              f"{torch.typename(params)}; pass model.parameters()")
    try:
        items = list(params)
    except TypeError as e:
        raise ParamsTypeError(f"params must be an iterable of tensors or dicts, got "
                              f"{torch.typename(params)}; pass model.parameters()") from e
    if not items:
        raise ParamsValueError("ZeroRedundancyOptimizer got an empty parameter list")
    if not (all(isinstance(p, torch.Tensor) for p in items)
            or all(isinstance(p, dict) for p in items)):
        raise ParamsTypeError("params must be all tensors or all parameter groups (dicts)")
    tensors = items if isinstance(items[0], torch.Tensor) else [
        p for g in items for p in ([g["params"]] if isinstance(g["params"], torch.Tensor)
                                   else g["params"])]
    kinds = {(torch.typename(t), t.is_sparse) for t in tensors}
    if len(kinds) > 1 or any(sparse for _, sparse in kinds):
        raise ParamsValueError(f"ZeroRedundancyOptimizer needs parameters of one dense type; "
                               f"got {sorted(k for k, _ in kinds)}: cast the module first "
                               "(e.g. model.float())")
    return items

