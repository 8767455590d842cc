"""Point-to-point messages in the monitor's log, for the Flight Recorder dump (flight.py).

A pipeline's activations and gradients and a parameter server's messages go by send and recv,
which are no collectives: the hang report names where a pipeline waits by its note (log.note).
But a dump that leaves them out hides half of what a pipeline rank did before it stopped, so
`microddp.comms`' send, recv, isend and irecv log each message here while a monitor is on: its
two ends, its tensor's dtype and shape, the line that sent it, and when it started and ended,
numbered per group apart from the collectives (torch's p2p_seq_id). The calls of microddp's own
algorithms go straight to the process group and are logged as the collective they make up.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist

from .log import Entry
from .patch import _outside, active, group_name


def begin(op: str, tensor: torch.Tensor, peer: int | None, group: Any, tag: int,
          async_op: bool = False) -> Entry | None:
    """Log a "send" or "recv" (`op`) of `tensor` to or from global rank `peer` on `group` with
    `tag`; the entry to `end`, or None when no monitor is on (or the message cannot be placed:
    a receive from any rank, a rank outside the group)."""
    mon = active()
    if mon is None or peer is None or _outside(group):
        return None
    me = dist.get_rank()
    src, dst = (me, peer) if op == "send" else (peer, me)
    entry = mon.log.begin_message(group_name(group), op, src, dst, tag, tensor,
                                  sys._getframe(1))
    if async_op:
        entry.locate_caller()  # the caller moves on
    return entry


def end(entry: Entry | None) -> None:
    """The message of `entry` is done (sent, or received)."""
    mon = active()
    if entry is not None and mon is not None:
        mon.log.end(entry)
