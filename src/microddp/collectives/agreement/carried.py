"""The ring's metadata check on 2 gloo ranks, carried beside its data instead of in front of it.

The agreement (agree.py) is a round of its own that every rank waits for before it posts a
byte of data; on 2 ranks it cost as much as the ring's two steps at small sizes (chapter 4).
Here each rank still sends the very same numbers (its header: shape, dtype, op, settings), on
the agreement's connection and tag, so it meets a rank that called another collective and
both raise the same errors; only the order around it changes:

1. post both data receives, on tags no other call uses (a per-process tag base, carried in
   the header so the other rank knows where to send);
2. send the header, receive the other's;
3. compare: on a mismatch, raise. Nothing size-dependent has been sent yet, so gloo cannot
   abort on a message of the wrong size, and the other rank raises too. The receives stay
   posted on tags no later call uses (_next_base);
4. otherwise send the data to the other's tag base and run the ring's two steps.

Only on 2 ranks: on more, a rank hears from one neighbour only. Where the first step's chunk
fits in INLINE_MAX_CHUNK bytes, the header *is* the first step (inline_ring_all_reduce_):
safe, because every message on the agreement's tag between 2 ranks is PAIR_WORDS long
(agree.py), so the two messages that meet are of one size whatever either rank called, and
the numbers are compared before a byte of the data is used.
"""

from __future__ import annotations

import array
import itertools

import torch

from ...shm.verdict import SLOTS, described, encode, judge
from ...transport.peers import COMBINE, Peers
from ..ring.plan import RingPlan
from .agree import FIRST_TAG, PAIR_WORDS

# Where a header carries its sender's tag base. It is past every field an agreement compares
# (at most 9), so a rank running `agree` reads the rest of the header and ignores it.
TAG_SLOT = SLOTS - 1
# Data tags: from here on, 4 per call (the ring's two steps use 1 and 2), below 2**30 (the
# sized tags, transport/sized_tags.py, begin there). Far above the tags of every other loop, so a stale
# receive never meets them.
TAG_BASE = 1 << 24
_WRAP = 1 << 27  # so that the tags stay below 2**30, where the sized tags begin
_calls = itertools.count()


def _next_base() -> int:
    """This process's data tags for its next carried call. Unique for 2**27 calls: a receive
    left posted by a refused call (step 3 above) could only match a message that long after."""
    return TAG_BASE + 4 * (next(_calls) % _WRAP)


class Header:
    """One rank's header for one kind of call, and a buffer for the other rank's; kept with the
    call (ring/plan.py), so a repeat call only stamps its tag base in and sends it."""

    def __init__(self, where: str, fields: dict, settings: dict):
        self.where, self.settings = where, settings
        self.fields = described(where, None, fields, settings)
        self.k = len(self.fields)
        # PAIR_WORDS long, as every message on the agreement's tag between 2 ranks (agree.py).
        self.mine = array.array("q", encode(self.fields))
        self.mine += array.array("q", bytes(8 * (PAIR_WORDS - len(self.mine))))
        self.theirs = array.array("q", bytes(8 * PAIR_WORDS))
        # Tensors over the arrays' memory: what goes on the wire is read and written there.
        self.mine_t = torch.frombuffer(self.mine, dtype=torch.int64)
        self.theirs_t = torch.frombuffer(self.theirs, dtype=torch.int64)

    def payloads(self, dtype: torch.dtype, mine: int, theirs: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Views, past the numbers, of `mine` elements of `dtype` in this rank's message and
        `theirs` in the other's: where a first chunk travels inline (it must fit)."""
        start = 8 * 2 * SLOTS  # a multiple of every element size

        def view(t: torch.Tensor, n: int) -> torch.Tensor:
            size = torch.empty(0, dtype=dtype).element_size()
            return t.view(torch.uint8)[start:start + n * size].view(dtype)

        return view(self.mine_t, mine), view(self.theirs_t, theirs)

    def stamp(self, base: int) -> None:
        """Write this call's tag base into the header: as a field, and negated in the second half
        (the layout `encode` gives every field)."""
        self.mine[TAG_SLOT], self.mine[SLOTS + TAG_SLOT] = base, -base

    def matches(self) -> bool:
        """Whether the other rank's header, once received, has every compared field equal."""
        return self.theirs[:self.k] == self.mine[:self.k]

    def refuse(self, me: int) -> None:
        """Raise the error an agreement would have raised on these two headers."""
        n = 2 * SLOTS
        combined = [max(a, b) for a, b in zip(self.mine[:n], self.theirs[:n], strict=True)]
        judge(self.where, me, self.fields, self.settings, combined, None)


def carried_ring_all_reduce_(peers: Peers, plan: RingPlan, name: str, header: Header) -> None:
    """The ring on 2 gloo ranks, whole chunks, every receive posted before any send, with the
    header exchanged before the data is sent (steps in the module docstring). Raises the
    agreement's MicroDDPError, on both ranks, if the headers differ."""
    other = 1 - peers.me
    (send0, recv0, into0, tag0), (send1, recv1, _, tag1) = plan.steps
    base = _next_base()
    # Both receives first, so that the other rank's sends find them announced. The gather's
    # lands in the chunk this rank sends in step 0: safe, see planned_ring_all_reduce_.
    got0 = peers.irecv(recv0, other, base + tag0) if recv0.numel() else None
    got1 = peers.irecv(recv1, other, base + tag1) if recv1.numel() else None
    header.stamp(base)
    heard = peers.irecv_main(header.theirs_t, other, FIRST_TAG)
    told = peers.isend_main(header.mine_t, other, FIRST_TAG)
    heard.wait()
    if not header.matches():
        told.wait()  # the other rank posted its receive for it: an agreement or a header
        header.refuse(peers.me)
    to = header.theirs[TAG_SLOT]
    sent0 = peers.isend(send0, other, to + tag0) if send0.numel() else None
    if got0 is not None:
        got0.wait()
        COMBINE[name](into0, recv0)
    if name == "avg":
        plan.mine.div_(2)
    sent1 = peers.isend(send1, other, to + tag1) if send1.numel() else None
    for work in (got1, sent0, sent1, told):
        if work is not None:
            work.wait()


def inline_ring_all_reduce_(peers: Peers, plan: RingPlan, name: str, header: Header,
                            inline: tuple[torch.Tensor, torch.Tensor]) -> None:
    """The ring on 2 gloo ranks for a first chunk of at most INLINE_MAX_CHUNK bytes: the
    header and that chunk in one message (module docstring), then the gather step. `inline`:
    header.payloads() for this plan's first step (what this rank sends, what it adds in).
    Raises the agreement's MicroDDPError, on both ranks, if the headers differ."""
    other = 1 - peers.me
    (send0, _, into0, _), (_, recv1, _, tag1) = plan.steps
    out, came = inline
    base = _next_base()
    # The gather's receive first: it lands in the chunk this rank sends in the first step,
    # which is copied into the header's message before that message leaves, and the other
    # rank sends into it only once it has that message.
    got1 = peers.irecv(recv1, other, base + tag1) if recv1.numel() else None
    heard = peers.irecv_main(header.theirs_t, other, FIRST_TAG)
    header.stamp(base)
    out.copy_(send0)
    told = peers.isend_main(header.mine_t, other, FIRST_TAG)
    heard.wait()
    if not header.matches():
        told.wait()
        header.refuse(peers.me)
    if into0.numel():
        COMBINE[name](into0, came)
    if name == "avg":
        plan.mine.div_(2)
    gather_step_(peers, other, plan.steps[1], header.theirs[TAG_SLOT] + tag1, got1, [told])


def gather_step_(peers: Peers, other: int, step: tuple, to: int, got, pending: list) -> None:
    """The 2-rank ring's last step, the gather: send this rank's completed chunk (`step`'s
    send) to tag `to`, take the other rank's (`got`, its receive posted earlier) into place,
    then wait for that send and every earlier one in `pending` (None entries skipped)."""
    send, recv, into, _ = step
    sent = peers.isend(send, other, to) if send.numel() else None
    if got is not None:
        got.wait()
        if into is not None:
            into.copy_(recv)
    for work in (*pending, sent):
        if work is not None:
            work.wait()
