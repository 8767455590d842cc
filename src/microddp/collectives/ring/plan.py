"""What the ring keeps per tensor object, for as long as that tensor lives: its plan and, for
repeat calls, the whole call ready to run again.

The plan: the ring runs 2(p-1) steps, each naming three slices of the tensor (what to send,
where to receive, what to add into or copy to). Cutting them is a few microseconds of Python
apiece, but it sits on every rank's critical path just before each send, where a delay costs
more than its CPU time (chapter 4 has the measurements), so the views are cut once and kept.
The incoming buffers are views of the shared scratch buffer of the moment; a plan keeps that
memory alive if the scratch buffer is later replaced by a larger one.

The memo (`recall`/`remember`): with `check=False` the bare loop, with `check=True` on 2 gloo
ranks the loop that carries the check beside the data (agreement/carried.py), its header
encoded once. A repeat call may skip the checks and set-up because nothing they looked at can
have changed: agreement across ranks is vouched for by the caller or by the header each call
still sends, and this rank's own checks (op, dtype, memory layout, group) are in the call's
signature, compared on every call. The memory's address is a safe test of "the same memory":
the kept views keep the old storage alive. Entries hold the tensor weakly and are dropped
when it is freed; the group is held weakly too (a destroyed group must not be kept alive).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...transport.peers import Peers, bounds, scratch

MAX_ENTRIES = 64  # per kind, oldest dropped first: a bound for code that makes endless tensors


class PerTensor:
    """A map from live tensor objects to values, each valid while its key still matches.

    Tensors are held weakly: an entry goes when its tensor is freed. Values must not hold the
    tensor either (a view holds its base): cut views from an alias over the same memory.
    """

    def __init__(self, limit: int = MAX_ENTRIES):
        self.limit = limit
        self._entries: dict[int, tuple[weakref.ref, tuple, Any]] = {}

    def get(self, tensor: torch.Tensor, key: tuple) -> Any:
        """The value kept for this very tensor under `key`, or None if none (or kept for
        another)."""
        entry = self._entries.get(id(tensor))
        if entry is not None and entry[0]() is tensor and entry[1] == key:
            return entry[2]
        return None

    def put(self, tensor: torch.Tensor, key: tuple, value: Any) -> None:
        """Keep `value` for `tensor` under `key`, evicting the oldest entry when full; forgotten
        when the tensor dies."""
        ident = id(tensor)
        if ident not in self._entries and len(self._entries) >= self.limit:
            self._entries.pop(next(iter(self._entries)))

        def forget(ref: weakref.ref, ident: int = ident) -> None:
            # Drop the entry only if it is still this tensor's: the id may be reused by then.
            if self._entries.get(ident, (None,))[0] is ref:
                del self._entries[ident]

        self._entries[ident] = (weakref.ref(tensor, forget), key, value)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether some entry was put for this tensor object (valid or not: see get)."""
        return id(tensor) in self._entries

    def __len__(self) -> int:
        return len(self._entries)


_calls = PerTensor()
_checked = PerTensor()  # calls with check=True: their loop carries the check (agreement/carried.py)


def _signature(tensor: torch.Tensor, op, group, check: bool = False) -> tuple | None:
    """What a call's checks and set-up depend on, besides what check=False vouches for, or
    None for a call that is not kept. Only an op given as a str (the default) is kept, so
    that comparing it with whatever a caller passes next is plain string equality. The group
    is the process group object itself, held weakly (None means the current default group,
    so a world set up anew never meets the old one's calls, and a destroyed group's calls
    never match again); without one there is nothing to keep."""
    if not isinstance(op, str):
        return None
    pg = group if group is not None else dist.group.WORLD
    if not isinstance(pg, dist.ProcessGroup):
        return None  # no world, or this process is off the group (new_group gave an int)
    key = (tensor.data_ptr(), tensor.numel(), tensor.dtype, tensor.device,
           tensor.is_contiguous(), op, weakref.ref(pg))
    # A checked call's check holds the shape too: a repeat must send it as it is now. Not
    # MICRODDP_DUPLEX, whose value the check also holds: reading the environment took 2 us
    # (warm) of a 4 KiB call's 200, and a call is kept only once the group's connections are
    # settled, after which the check holds the settled value (transport/duplex.py's
    # duplex_setting), not the variable.
    return key + (tuple(tensor.shape),) if check else key


def recall(tensor: torch.Tensor, op, group, check: bool = False
           ) -> Callable[[Peers], object] | None:
    """The loop `remember`ed for this tensor, op, group and `check`, if nothing it depends on
    changed: call it with the group's Peers."""
    store = _checked if check else _calls
    if not store.holds(tensor):
        return None
    key = _signature(tensor, op, group, check)
    return None if key is None else store.get(tensor, key)


def remember(tensor: torch.Tensor, op, group, loop: Callable[[Peers], object],
             check: bool = False) -> None:
    """Keep `loop` to redo this call on a contiguous `tensor`. It must hold neither the
    tensor nor the group: it is given the group's Peers on every call."""
    key = _signature(tensor, op, group, check)
    if key is not None:
        (_checked if check else _calls).put(tensor, key, loop)


def remembered_calls() -> int:
    """How many calls are kept (for tests)."""
    return len(_calls)


@dataclass(frozen=True)
class RingPlan:
    """Steps of the ring on one flat tensor, for rank `me` of `size`.

    steps: p-1 reduce-scatter steps, then p-1 gather steps, each (send this, receive into this,
      then add it into / copy it to this chunk, tag). The reduce-scatter adds what it
      receives; a gather step copies it, or has None there when its message lands straight
      in its chunk. Steps with nothing to add or copy only move bytes.
    mine: the chunk this rank completes (divided by p for avg).
    """

    mine: torch.Tensor
    steps: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int], ...]


_plans = PerTensor()  # per tensor object, at most MAX_ENTRIES


def make_plan(data: torch.Tensor, size: int, me: int, preposted: bool = False) -> RingPlan:
    """Cut the views for a ring all-reduce of 1-D `data`, chunked as bounds() does.

    Step s sends chunk me-s-1 and receives chunk me-s-2 (mod p), numbering the gather steps
    on after the reduce-scatter ones; tags are 1 + s, so consecutive steps never match each
    other's messages. Where messages land:
    - `preposted` (every receive posted before the first send): each step in its own row of
      a scratch inbox, since the chunks a gather step lands in are still being sent when the
      receives are posted; the gather steps then copy;
    - otherwise, the reduce-scatter in alternate halves of a scratch buffer, so the next
      step's receive can be posted while this step's partial is being added, and the gather
      straight in its chunk.
    """
    p, r = size, me
    off = bounds(data.numel(), p)
    # Views of `data` would keep the caller's tensor object alive (a view holds its base),
    # and with it this plan: cut them from a new tensor over the same memory instead.
    with torch.no_grad():
        alias = data.new_empty(0).set_(data.untyped_storage(), data.storage_offset(),
                                       (data.numel(),))
    chunk = [alias[off[c]:off[c + 1]] for c in range(p)]
    width = max(c.numel() for c in chunk)
    n_steps = 2 * (p - 1)
    if preposted:
        rows = scratch("ring-inbox", n_steps * width, data.dtype, data.device).view(n_steps, width)
    else:
        halves = scratch("ring-incoming", width * min(2, p - 1), data.dtype,
                         data.device).view(min(2, p - 1), width)
    steps = []
    for s in range(n_steps):
        send, land = chunk[(r - s - 1) % p], chunk[(r - s - 2) % p]
        if preposted:
            steps.append((send, rows[s, :land.numel()], land, 1 + s))
        elif s < p - 1:
            steps.append((send, halves[s % 2, :land.numel()], land, 1 + s))
        else:
            steps.append((send, land, None, 1 + s))
    return RingPlan(chunk[r], tuple(steps))


def plan_for(tensor: torch.Tensor, data: torch.Tensor, size: int, me: int,
             preposted: bool = False) -> RingPlan:
    """The plan for `data`, the flat view of the caller's `tensor`: kept while `tensor` lives.

    Only pass a `data` that shares `tensor`'s memory (a contiguous tensor's view(-1)); for a
    packed copy, call make_plan directly: a copy's address changes every call.
    """
    key = (data.data_ptr(), data.numel(), data.dtype, data.device, size, me, preposted)
    plan = _plans.get(tensor, key)
    if plan is None:
        plan = make_plan(data, size, me, preposted)
        _plans.put(tensor, key, plan)
    return plan


def cached_plans() -> int:
    """How many plans are kept (for tests)."""
    return len(_plans)
