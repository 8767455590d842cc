"""Ring plans: every view one ring all-reduce of a tensor needs, cut once and reused.

The ring runs 2(p-1) steps, and each step names three slices of the tensor (what to send,
where to receive, what to add into or copy to). Cutting them is a few microseconds of Python
apiece, but it sits on the critical path of every rank, just before each send, and on this
2-core host it cost far more than its CPU time. Measured interleaved, with the slices cut
per call rather than kept: on 2 ranks, a 1-2 MiB all-reduce (the plain ring) took 0.06-0.19
ms longer; the ring that posts every receive first took 1.19-1.38x as long on 2 ranks at
64-512 KiB, and 1.13-1.26x on 4 ranks at 256 KiB-1 MiB (level at 64 KiB; chapter 4). The
incoming buffers are views of the shared scratch buffer of the moment; a plan keeps that
memory alive if the scratch buffer is later replaced by a larger one.

So the views are kept, per tensor object, for as long as that tensor lives: the entry holds
only a weak reference to the tensor and is dropped when the tensor is freed. Before reuse the
plan is checked against the tensor's address, length, dtype and this rank's place in the
group, so a tensor whose memory was swapped (`t.set_(...)`, `t.data = ...`) gets a new one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._group import bounds, scratch
from ._memo import PerTensor


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
