"""Tags that fix a message's size, so that data may leave before the check has been read.

gloo aborts the process when a message meets a receive of another size on the same tag
(checked: an 100-float send into a 50-float receive ends the receiving rank with SIGABRT).
So nothing whose size depends on the caller's tensor may be sent before the check has said
that the other rank's tensor is alike; and waiting for the check before sending puts one
wake-up of the caller's thread, and the first step's whole transfer, in front of every call.

Here a message's tag *is* its size: `sized_tag(nbytes)` is SIZED_BASE + nbytes, and only
messages of exactly that many bytes are ever sent or received on it. Two messages that meet
are then of one size, whatever either rank called, so the ring's first step may leave as the
call starts (early.py) and gloo cannot be made to abort. The check is still read before
a byte of what arrived is used; ranks whose checks agree have equal shapes, so their first
steps meet on one tag.
"""

from __future__ import annotations

import torch

from .duplex import duplex, duplex_decided
from .peers import Peers, wait_all

# What a refused call leaves behind, and how both ranks settle it:
#
# What a refused call must not leave behind is a message sent early that no receive took, or a
# receive posted early that nothing filled: a later call of the same size would meet it and use
# another call's data. So on a refusal both ranks `settle`: each has read both ranks' posts in
# the shared-memory check (shm/agreement.py: a ring's says where it sent and posted early), hence
# knows where the other sent early and where it posted early; each receives (and drops) the
# other's message where its own receive did not take it, and sends a filler where its own
# message did not fill the other's receive. A rank that met the ring with an agreement of
# another collective (agree.py) does the same with nothing of its own early. Every early message and receive is
# then complete on both ranks, and the sized tags are empty again, before either rank raises.

# Above the rings' per-call tags (carried.py's and early.py's end below 2**30) and,
# with the size added, below 2**31, the largest tag gloo accepts. (A pipeline's tags grow with
# its micro-batches, but never reach 2**30 in any pipeline this host can hold.)
SIZED_BASE = 1 << 30
SIZED_MAX_BYTES = (1 << 31) - 1 - SIZED_BASE


def sized_tag(nbytes: int) -> int | None:
    """The tag on which messages of exactly `nbytes` bytes travel early; None if there is none
    (an empty message, or one over SIZED_MAX_BYTES: about 1 GiB)."""
    if nbytes <= 0 or nbytes > SIZED_MAX_BYTES:
        return None
    return SIZED_BASE + nbytes


def settle(peers: Peers, other: int, theirs: tuple[int, int] | None,
           mine: tuple[int, int] | None, works: list) -> None:
    """After a refused check, complete every message either rank sent or posted early on a
    sized tag (module docstring). `theirs` and `mine`: the (send tag, receive tag) each rank
    used early, None for a rank that used none; `works`: this rank's own early send and
    receive, which the other rank's early messages or its `settle` complete."""
    ops = list(works)
    if theirs is not None:
        # On the connections the ring's messages take: a ring sends early only once the
        # group's first ring call has settled them, on both ranks (transport/duplex.py).
        if duplex_decided(peers):
            peers = duplex(peers)
        their_send, their_recv = theirs
        if mine is None or mine[1] != their_send:  # no receive of mine took it: drop it here
            ops.append(peers.irecv(_bytes(their_send), other, their_send))
        if mine is None or mine[0] != their_recv:  # no message of mine filled it: fill it
            ops.append(peers.isend(_bytes(their_recv), other, their_recv))
    wait_all(ops)


def _bytes(tag: int) -> torch.Tensor:
    """A buffer of exactly the size `tag` stands for."""
    return torch.zeros(tag - SIZED_BASE, dtype=torch.uint8)
