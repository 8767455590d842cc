"""The ring on 2 ranks that share memory: checked in shared memory, its first step sent at once.

A checked call must not let data leave before it knows the other rank's tensor is alike
(gloo aborts on a size mismatch), and waiting for the other's check before sending puts its
arrival, a wake-up and the first step's transfer in front of every call. Here the check is in
front of nothing. On 2 gloo ranks of a group that shares memory (shm/agreement.py), with a
connection per direction (transport/duplex.py), a call:

1. posts its check in shared memory (the agreement's numbers, plus where it sends and posts its
   first step early: EXTRA words beside them), without waiting for anyone;
2. posts both data receives (the first step's on its sized tag, transport/sized_tags.py; the second's on
   a tag of this agreement's own), then sends its first step on its sized tag;
3. reads the check and compares. On a mismatch, settles (transport/sized_tags.py: each rank takes or
   fills what the other sent or posted early) and raises on both ranks what the agreement
   would have; what arrived early was never used;
4. otherwise adds what arrived, sends the second step and finishes.

The check is then writing and comparing a few numbers, kept to a few Python steps
(shm/agreement.py's `agrees`), since right after the data moved each step finds its objects
out of cache (chapter 4 has what it cost). Only non-empty chunks take this path.
"""

from __future__ import annotations

import array

from ...transport.peers import COMBINE, Peers
from ...transport.sized_tags import sized_tag
from ..ring.plan import RingPlan
from .agree import described, encode, read_in_memory, shared_agreement
from .carried import gather_step_

# The second step's tags: 4 per agreement from here, below 2**30 where the sized tags begin.
TAG_BASE = 1 << 24
_WRAP = 1 << 27


class EarlyCall:
    """What a repeat call of one kind sends with its check: the agreement's numbers and the
    sized tags of its first step (kept with the call, ring/plan.py's memo)."""

    def __init__(self, where: str, fields: dict, settings: dict, plan: RingPlan):
        self.where, self.settings = where, settings
        self.fields = described(where, None, fields, settings)
        self.mine = array.array("q", encode(self.fields))
        send0, recv0 = plan.steps[0][0], plan.steps[0][1]
        self.tags = (sized_tag(send0.nbytes), sized_tag(recv0.nbytes))


def goes_early(numel: int, element_size: int) -> bool:
    """Whether a tensor's first step can go early on 2 ranks: both its messages (half the
    tensor each, the larger first) have a sized tag: none is empty, none is over
    sized_tags.SIZED_MAX_BYTES."""
    return numel >= 2 and sized_tag(-(-numel // 2) * element_size) is not None


def _check(peers: Peers, box, seq: int, call: EarlyCall, works: list) -> None:
    """Read the check of agreement `seq` (the other rank's post is there, or comes at once);
    on a mismatch settle the early messages (`works`: this rank's own ones not yet waited
    for) and raise the agreement's error (shm/checked.py's read_in_memory)."""
    read_in_memory(peers, box, seq, call.mine, call.where, call.fields, call.settings, None,
                   call.tags, works)


def early_ring_all_reduce_(peers: Peers, plan: RingPlan, name: str, call: EarlyCall) -> None:
    """The ring on 2 ranks with its check in shared memory and its first step sent before the
    check is read (module docstring). Raises the agreement's MicroDDPError, on both ranks, if
    the ranks' calls differ."""
    other = 1 - peers.me
    (send0, recv0, into0, _), (_, recv1, _, tag1) = plan.steps
    box = shared_agreement(peers)
    seq = box.post(call.mine, call.tags)
    base = TAG_BASE + 4 * (seq % _WRAP)
    out, into = call.tags
    got0 = peers.irecv(recv0, other, into)
    got1 = peers.irecv(recv1, other, base + tag1) if recv1.numel() else None
    sent0 = peers.isend(send0, other, out)
    answer = box.agrees(seq, call.mine)
    if answer is None:  # not posted yet: it will read this rank's check, then send or fill
        got0.wait()     # got0, so this rank needs no wake-up for the check
        if not box.agrees(seq, call.mine):
            _check(peers, box, seq, call, [sent0])
    else:  # the other rank is here: its check is read now, without a wait
        if not answer:
            _check(peers, box, seq, call, [sent0, got0])
        got0.wait()
    COMBINE[name](into0, recv0)
    if name == "avg":
        plan.mine.div_(2)
    gather_step_(peers, other, plan.steps[1], base + tag1, got1, [sent0])
