"""`fully_shard`: ZeRO-3 in the shape of FSDP2's, applied module by module.

    for block in model.blocks:
        zero.fully_shard(block)
    zero.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # the user's own, over the shards
    loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()

Each call makes one unit (fsdp_unit.py) of the module's parameters that no nested call took:
sharded by dim-0 chunks as FSDP2's are, gathered just before the module's forward (and again
before its backward when `reshard_after_forward`), its gradients averaged into the shards'
`.grad` as soon as backward has made them all. The module's class becomes a subclass of
`FSDPModule` (FSDP2's methods: set_requires_gradient_sync, unshard, reshard) with two of
microddp's: full_state_dict and load_full_state_dict. One difference: a shard is a plain
tensor (FSDP2's DTensor.to_local()), so code reading `p.shape` sees the local shape, and a
global gradient norm needs zero.clip_grad_norm_ (torch's would clip by this rank's norm).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from .. import comms
from ..errors import MicroDDPError
from .fsdp_unit import Unit


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's: compute in `param_dtype` (the parameters are gathered in it), reduce the
    gradients in `reduce_dtype` (default: param_dtype), keep the shards and the optimizer in
    the parameters' own dtype; `output_dtype` casts the module's outputs."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


def _units(module: nn.Module) -> list[Unit]:
    return [u for m in module.modules() if (u := getattr(m, "_mdp_unit", None)) is not None]


class FSDPModule:
    """What fully_shard adds to a module's class (FSDP2's names where FSDP2 has them)."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """False: backward accumulates the full gradients locally, with no communication
        (gradient accumulation); the first backward after setting True again averages them
        all into the shards' .grad."""
        for unit in (_units(self) if recurse else [getattr(self, "_mdp_unit", None)]):
            if unit is not None:
                unit.sync = requires_gradient_sync

    def unshard(self) -> None:
        """Gather this module's own unit's full parameters now (every rank)."""
        if getattr(self, "_mdp_unit", None) is not None:
            self._mdp_unit.unshard()

    def reshard(self) -> None:
        """Free this module's own unit's full parameters."""
        if getattr(self, "_mdp_unit", None) is not None:
            self._mdp_unit.reshard()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's state_dict with every parameter whole, on every rank (one unit
        gathered at a time; every rank must call it)."""
        full = {}
        for unit in _units(self):
            for shard, t in zip(unit.sharded, unit.full_tensors(), strict=True):
                full[id(shard)] = t
        out = self.state_dict()
        for name, p in self.named_parameters():
            if id(p) in full:
                out[name] = full[id(p)]
        return out

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a whole-model state_dict (as full_state_dict returns): each rank keeps its
        rows of every sharded parameter."""
        names = {id(p): n for n, p in self.named_parameters()}
        rest = dict(state_dict)
        for unit in _units(self):
            keys = [names[id(s)] for s in unit.sharded]
            missing = [k for k in keys if k not in rest]
            if missing:
                raise MicroDDPError(f"the state dict has no {missing}; load a full state dict "
                                    "of this model (full_state_dict())")
            unit.load_full([rest.pop(k) for k in keys])
        sharded = {n for n, p in self.named_parameters() if getattr(p, "_mdp_fully_shard", 0)}
        result = self.load_state_dict(rest, strict=False)
        missing = [k for k in result.missing_keys if k not in sharded]
        if missing or result.unexpected_keys:
            raise MicroDDPError(f"the state dict does not fit the model: missing {missing}, "
                                f"unexpected {result.unexpected_keys}")


_classes: dict[type, type] = {}


def _group_of(mesh: Any):
    """The process group to shard over: the world's, a 1-D DeviceMesh's, or a group."""
    if mesh is None:
        return None
    if hasattr(mesh, "get_group"):
        if getattr(mesh, "ndim", 1) != 1:
            raise MicroDDPError("fully_shard shards over a 1-D mesh (no HSDP); pass a 1-D "
                                "DeviceMesh, a process group, or None for every rank")
        return mesh.get_group()
    return mesh


def fully_shard(module: nn.Module, *, mesh: Any = None, reshard_after_forward: bool | None = True,
                shard_placement_fn: Any = None,
                mp_policy: MixedPrecisionPolicy | Any = MixedPrecisionPolicy(),
                offload_policy: Any = None, ignored_params: set | None = None) -> nn.Module:
    """Shard `module`'s parameters (those no nested fully_shard took) over `mesh`'s ranks,
    FSDP2's way. Returns the module, whose class now also derives from FSDPModule.
    `mp_policy`: ours or torch's MixedPrecisionPolicy (read by attribute)."""
    if isinstance(module, (list, tuple)):
        raise MicroDDPError("fully_shard takes one module here; wrap the modules in an "
                            "nn.ModuleList's parent or call it on each")
    if shard_placement_fn is not None:
        raise MicroDDPError("shard_placement_fn is not supported: shards are dim-0 chunks; "
                            "leave it None")
    if offload_policy is not None and type(offload_policy).__name__ != "OffloadPolicy":
        raise MicroDDPError("CPU offload is not supported; leave offload_policy at its default")
    group = _group_of(mesh)
    if comms.group_rank(group) < 0:
        raise MicroDDPError("this rank is not in the mesh; call fully_shard on its ranks only")
    if getattr(module, "_mdp_unit", None) is not None:
        raise MicroDDPError(f"{type(module).__name__} is already fully_shard-ed")
    ignored = {id(p) for p in (ignored_params or ())}
    named, seen = [], {}
    for mname, sub in module.named_modules():
        for pname, p in sub.named_parameters(recurse=False):
            if getattr(p, "_mdp_fully_shard", False) or id(p) in ignored:
                continue
            if id(p) in seen:
                raise MicroDDPError(f"parameter {mname}.{pname} is tied to {seen[id(p)]}: "
                                    "fully_shard cannot shard one tensor in two places; untie "
                                    "them or leave one in ignored_params")
            seen[id(p)] = f"{mname}.{pname}"
            named.append((sub, pname, p))
    kinds = {(p.dtype, p.device) for _, _, p in named}
    if len(kinds) > 1:
        raise MicroDDPError(f"fully_shard needs one dtype and device per unit, got {kinds}; "
                            "cast the module (e.g. model.float()) first")
    cls = type(module)
    if not issubclass(cls, FSDPModule):
        if cls not in _classes:
            _classes[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        module.__class__ = _classes[cls]
    if not named:
        return module
    unit = Unit(named, group, mp_policy, reshard_after_forward is not False)
    module._mdp_unit = unit
    _attach(module, unit)
    return module


def _cast(tree: Any, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return tree
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor)
                    and t.is_floating_point() else t, tree)


def _attach(module: nn.Module, unit: Unit) -> None:
    """The hooks that gather, free and reduce around the module's forward and backward."""
    trainable = [f for f in unit.full if f.requires_grad]
    state = {"ready": 0, "queued": False}

    def end_of_backward() -> None:
        # Parameters backward did not reach owe their unit's reduce: zeros, on every rank.
        if unit.sync and 0 < state["ready"] < len(trainable):
            unit.reduce_grads()
        unit.finish_reduce()
        state["ready"], state["queued"] = 0, False
        unit.reshard()

    def queue_end() -> None:
        if not state["queued"]:
            state["queued"] = True
            torch.autograd.Variable._execution_engine.queue_callback(end_of_backward)

    def pre_backward(_grad: torch.Tensor) -> None:
        queue_end()
        unit.unshard()

    def pre_forward(_module, args, kwargs):
        unit.unshard()
        unit.register(unit.full)
        if unit.mp.cast_forward_inputs and unit.mp.param_dtype is not None:
            args, kwargs = _cast((args, kwargs), unit.mp.param_dtype)
        return args, kwargs

    def post_forward(_module, _args, output):
        unit.register(unit.sharded)
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(pre_backward)
        if unit.reshard_after_forward:
            unit.reshard()
        return _cast(output, unit.mp.output_dtype)

    def on_grad(_param: torch.Tensor) -> None:
        queue_end()
        if not unit.sync:
            return
        state["ready"] += 1
        if state["ready"] == len(trainable):
            unit.reduce_grads()
            state["ready"] = -len(unit.full)  # done for this backward: the callback skips it
            unit.reshard()

    for f in trainable:
        f.register_post_accumulate_grad_hook(on_grad)
    module.register_forward_pre_hook(pre_forward, with_kwargs=True)
    module.register_forward_hook(post_forward)


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0,
                    group: Any = None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over fully_shard-ed parameters: the norm of the whole
    gradient (every rank's shards), not of this rank's; every rank must call it."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if norm_type == float("inf"):
        local = max((g.abs().max() for g in grads if g.numel()), default=torch.tensor(0.0))
        total = local.float().reshape(1).clone()
        comms.all_reduce(total, op="max", group=group)
        norm = total[0]
    else:
        local = sum((g.float().pow(norm_type).sum() for g in grads), torch.tensor(0.0))
        total = local.reshape(1).clone()
        comms.all_reduce(total, group=group)
        norm = total[0] ** (1.0 / norm_type)
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(scale.to(g.dtype))
    return norm
