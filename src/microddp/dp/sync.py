"""Making replicas identical: check that every rank built the same model, then copy rank 0's
parameters and buffers to everyone (a replica that starts different stays different)."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..comms import distributed, given_group
from ..errors import MicroDDPError
from ..transport.objects import all_gather_values
from .buckets import MiB, plan_buckets

BROADCAST_BUCKET_BYTES = 250 * MiB  # PyTorch's broadcast_bucket_size
# torch >= 2.2; without it a copy bumps the version counter, as before.
_preserve_version = getattr(torch.autograd, "_unsafe_preserve_version_counter", nullcontext)


def global_rank(group, group_rank: int) -> int:
    """The global rank of `group_rank` in `group` (collectives take global ranks). A group
    torch does not know (comms.given_group) is its own world: the same number."""
    if group is None or given_group(group):
        return group_rank
    return dist.get_global_rank(group, group_rank)


@torch.no_grad()
def broadcast_coalesced(tensors: Sequence[torch.Tensor], src: int = 0, group=None,
                        bucket_bytes: int = BROADCAST_BUCKET_BYTES,
                        keep_versions: bool = False) -> None:
    """Overwrite `tensors` with rank `src`'s copies, a few large messages instead of many small.

    `keep_versions`, for the buffers each forward syncs: as in torch, the copy leaves their
    autograd version counters alone, so a buffer an earlier forward saved for its backward
    (eval-mode BatchNorm) does not make that backward fail."""
    tensors = [t for t in tensors if t.numel() > 0]
    if not tensors or not distributed(group):
        return
    # A group torch does not know takes the root as its own rank (src is one: global_rank)
    root = {"group_src": src} if given_group(group) else {"src": src}
    for indices in plan_buckets(tensors, [bucket_bytes]):
        chunk = [tensors[i] for i in indices]
        flat = _flatten_dense_tensors([t.detach() for t in chunk])
        dist.broadcast(flat, group=group, **root)
        for t, new in zip(chunk, _unflatten_dense_tensors(flat, chunk), strict=True):
            with _preserve_version(t) if keep_versions else nullcontext():
                t.copy_(new)


def describe(module: nn.Module, buffers: bool = True) -> list[tuple]:
    """Name, shape, dtype, strides and requires_grad of every parameter (and buffer, without
    strides): what all replicas must agree on.

    requires_grad: a parameter frozen on one rank only gets no gradient there, so the ranks
    would put different tensors in one bucket (a wrong average, then a mismatched collective).

    Strides, as torch checks them: a gradient lands in its bucket in its parameter's memory
    order, so one rank's channels_last weight against another's row-major one would add
    mismatched elements. Buffers are copied element by element: their order does not matter.
    """
    def entry(kind: str, name: str, t: torch.Tensor, strides: bool) -> tuple:
        return (f"{kind} '{name}'", tuple(t.shape), str(t.dtype).replace("torch.", ""),
                tuple(t.stride()) if strides else None,
                ("trainable" if t.requires_grad else "frozen") if strides else None)

    items = [entry("parameter", n, t, True) for n, t in module.named_parameters()]
    if buffers:
        items += [entry("buffer", n, t, False) for n, t in module.named_buffers()]
    return items


def verify_same_model(module: nn.Module, group=None, buffers: bool = True,
                      settings: dict | None = None, wrapper: str = "DistributedDataParallel",
                      ) -> None:
    """Raise MicroDDPError on every rank (not a hang on some) if the replicas' layouts differ.
    `buffers`: compare the buffers too (they will be overwritten with rank 0's). `settings`:
    the wrapper's own arguments that must agree too (bucket sizes, a ZeRO stage), by name;
    one exchange carries both."""
    if not distributed(group):
        return
    mine = describe(module, buffers)
    gathered = all_gather_values([mine, {k: v if isinstance(v, str) else repr(v)
                                         for k, v in (settings or {}).items()}],
                                 group=group)
    # JSON turns tuples into lists; back to tuples, so every rank's entries compare and print alike
    everyone = [[tuple(tuple(x) if isinstance(x, list) else x for x in e) for e in desc]
                for desc, _ in gathered]
    problem = first_difference(everyone)
    if problem:
        raise MicroDDPError(
            f"the model differs across ranks: {problem}; build the same model (same code, same "
            f"arguments) on every rank before wrapping it in {wrapper}")
    problem = setting_difference([chosen for _, chosen in gathered])
    if problem:
        raise MicroDDPError(f"{wrapper} was built with different arguments on different ranks: "
                            f"{problem}; pass the same arguments on every rank")


def _by_rank(seen: dict[str, list[int]]) -> str:
    """"ranks 0, 2: x; rank 1: y": who holds which value."""
    return "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {w}"
                     for w, r in seen.items())


def setting_difference(everyone: list[dict[str, str]]) -> str | None:
    """Describe the first setting whose value is not the same on every rank."""
    for name in dict.fromkeys(k for chosen in everyone for k in chosen):
        seen: dict[str, list[int]] = {}
        for rank, chosen in enumerate(everyone):
            seen.setdefault(f"{name}={chosen.get(name, 'missing')}", []).append(rank)
        if len(seen) > 1:
            return f"{name} is not the same everywhere ({_by_rank(seen)})"
    return None


def first_difference(everyone: list[list[tuple]]) -> str | None:
    """Describe the first parameter or buffer whose name, shape, dtype, strides or
    requires_grad are not the same everywhere (each named only when the ones before agree)."""
    tables = [{name: rest for name, *rest in desc} for desc in everyone]
    names = list(dict.fromkeys(name for desc in everyone for name, *_ in desc))
    for name in names:
        for aspect in ("shape", "strides", "requires_grad"):
            seen: dict[str, list[int]] = {}
            for rank, table in enumerate(tables):
                if name not in table:
                    what = "no such entry"
                elif aspect == "shape":
                    what = f"shape {table[name][0]} {table[name][1]}"
                elif aspect == "strides":
                    what = f"strides {table[name][2]}"
                else:
                    what = f"{table[name][3]}"
                seen.setdefault(what, []).append(rank)
            if len(seen) > 1:
                hint = {"strides": " (a memory format such as channels_last on some ranks only?)",
                        "requires_grad": " (requires_grad differs: freeze the same parameters "
                                         "on every rank)"}.get(aspect, "")
                return f"{name} is not the same everywhere ({_by_rank(seen)}){hint}"
    orders = {tuple(name for name, *_ in desc) for desc in everyone}
    if len(orders) > 1:
        return "parameters and buffers are registered in a different order on different ranks"
    return None


def sync_module_states(module: nn.Module, src: int = 0, group=None, buffers: bool = True) -> None:
    """Copy rank `src`'s parameters (and buffers) into every replica."""
    tensors = [p for p in module.parameters()]
    if buffers:
        tensors += [b for b in module.buffers()]
    broadcast_coalesced(list(dict.fromkeys(tensors)), src, group)
