"""The ring all-reduce's loops: every order in which a ring step's messages can go, each
running the same reduce-scatter + all-gather (ring.py) on views cut beforehand (plan.py).

- `planned_ring_all_reduce_`: one message per step; "plain" (each receive beside its send),
  "lookahead" (the next receive posted before the add) or "receive-first" (2 ranks with a
  connection per direction: both receives, then the send); on NCCL, each step as one batch.
- `preposted_ring_all_reduce_`: every receive posted before the first send (small chunks).
- `pipelined_ring_all_reduce_`: each chunk cut into segments that travel independently, so
  segment j+1 arrives while segment j is being reduced, receives posted ahead into a fixed
  pool of buffers (any p, large chunks).
- `pair_all_reduce_`: 2 ranks on one connection, large chunks: both exchanges of halves cut
  into segments, a segment added and sent back the moment it lands.

Which one runs is policy.py's choice; the loops that carry the metadata check beside the data
are collectives/agreement/ (carried.py, early.py).
"""

from __future__ import annotations

from collections import deque

import torch

from ...transport.peers import COMBINE, Peers, bounds, scratch, wait_all
from .plan import RingPlan
from .policy import segments_per_chunk


def planned_ring_all_reduce_(peers: Peers, plan: RingPlan, name: str, how: str = "plain") -> None:
    """The plain ring, from views cut beforehand: one message per step, send first.

    Between sends there is nothing but the wire calls and the add (see plan.py for why).
    Each step adds what it received before waiting for its own send to finish: the add
    writes a chunk other than the one on the wire, so it overlaps the send's last bytes.
    `how` is the message order `posting` chose. With "lookahead" (gloo only), each step posts
    the next step's receive before adding: gloo holds a send back until the receiver has
    announced its buffer, so the neighbour's next send can start while this rank is still
    adding, without waiting for it to be scheduled. The reduce-scatter alternates two
    incoming buffers. A gather step receives into a chunk whose own send may still be going
    out (on 2 ranks, the first step's), and that is safe: what lands there is that chunk
    completed, which cannot exist before every rank's partial of it, this rank's message
    included, has arrived, so no byte lands before the last byte has left. "receive-first"
    (2 ranks with a connection per direction, transport/duplex.py) posts this step's receive and the
    next one before the send, so that every send finds its receiver ready (the same reasoning
    makes the early gather receive safe). Steps whose `into` is None only move bytes.
    """
    if peers.nccl:
        _batched_ring_all_reduce_(peers, plan, name)
        return
    p = peers.size
    nxt, prv = (peers.me + 1) % p, (peers.me - 1) % p
    combine = COMBINE[name]
    steps = plan.steps
    first = how == "receive-first"
    lookahead = first or how == "lookahead"

    def post(k: int):
        recv, tag = steps[k][1], steps[k][3]
        return peers.irecv(recv, prv, tag) if recv.numel() else None

    def start(k: int):
        send, tag = steps[k][0], steps[k][3]
        return peers.isend(send, nxt, tag) if send.numel() else None

    ahead = None  # the next step's receive, when posted early
    for k, (_, recv, into, _) in enumerate(steps):
        sent = None if first else start(k)
        posted = ahead if ahead is not None else post(k)
        ahead = None
        if lookahead and k + 1 < len(steps):
            ahead = post(k + 1)
        if first:
            sent = start(k)
        if posted is not None:
            posted.wait()
            if into is not None:
                combine(into, recv)
        if k == p - 2 and name == "avg":  # divide only the chunk this rank owns: 1/p of the work
            plan.mine.div_(p)
        if sent is not None:
            sent.wait()  # exactly once: a second wait() on a gloo send never returns


def _batched_ring_all_reduce_(peers: Peers, plan: RingPlan, name: str) -> None:
    """The plain ring on NCCL: each step's send and receive go as one batch, which keeps
    unmatched pairs from blocking its streams."""
    p = peers.size
    nxt, prv = (peers.me + 1) % p, (peers.me - 1) % p
    combine = COMBINE[name]
    for k, (send, recv, into, tag) in enumerate(plan.steps):
        wait_all(peers.exchange(send, nxt, recv, prv, tag))
        if into is not None and recv.numel():
            combine(into, recv)
        if k == p - 2 and name == "avg":
            plan.mine.div_(p)


def preposted_ring_all_reduce_(peers: Peers, plan: RingPlan, name: str) -> None:
    """The ring for small chunks (one message per step), with all 2(p-1) receives posted
    before the first send, each into its own inbox row (`make_plan(..., preposted=True)`).

    gloo holds a send back until the receiver has announced its buffer; announcing every
    buffer up front takes that round trip out of each step, which is most of a small
    message's cost. The reduce-scatter adds each row into its chunk, the gather copies it
    there; steps whose `into` is None only move bytes.
    """
    p = peers.size
    nxt, prv = (peers.me + 1) % p, (peers.me - 1) % p
    combine = COMBINE[name]
    steps = plan.steps
    recvs = [peers.irecv(recv, prv, tag) if recv.numel() else None for _, recv, _, tag in steps]
    sends = []
    for s, (send, recv, into, tag) in enumerate(steps):
        if s == p - 1:  # the gather phase overwrites chunks sent earlier: let those sends finish
            wait_all(sends)
            sends = []
        if send.numel():
            sends.append(peers.isend(send, nxt, tag))
        if recvs[s] is not None:
            recvs[s].wait()
            if into is not None:
                if s < p - 1:
                    combine(into, recv)
                else:
                    into.copy_(recv)
        if s == p - 2 and name == "avg":  # divide only the chunk this rank owns
            plan.mine.div_(p)
    wait_all(sends)


def pipelined_ring_all_reduce_(peers: Peers, data: torch.Tensor, name: str,
                               segment_bytes: int, window: int) -> None:
    """In place on a 1-D tensor: op over ranks, via 2(p-1) ring steps of k segments each, with
    up to `window` receives posted ahead (and as many scratch segments, at most the (p-1)k
    of the reduce-scatter). Nothing is allocated per step."""
    p, r = peers.size, peers.me
    nxt, prv = (r + 1) % p, (r - 1) % p
    off = bounds(data.numel(), p)
    width = max(off[i + 1] - off[i] for i in range(p))
    k = segments_per_chunk(width, data.element_size(), segment_bytes)
    # seg[c][j]: segment j of chunk c, as a view; chunks differ by at most one element.
    seg = [[data[off[c] + a:off[c] + b] for a, b in _pairs(bounds(off[c + 1] - off[c], k))]
           for c in range(p)]
    steps = 2 * (p - 1)
    rs_steps = p - 1
    combine = COMBINE[name]

    # Numbering the gather steps on after the reduce-scatter ones, step s always sends chunk
    # r-s-1 and receives chunk r-s-2 (mod p), in both phases.
    def send_chunk(s: int) -> int:
        return (r - s - 1) % p

    def recv_chunk(s: int) -> int:
        return (r - s - 2) % p

    tasks = [(s, j) for s in range(steps) for j in range(k)]
    seg_width = max(t.numel() for chunk in seg for t in chunk)
    # Only the reduce-scatter's receives need a buffer of their own (the gather's land in place).
    slots = min(window, rs_steps * k)
    pool = scratch("ring-pipeline", slots * seg_width, data.dtype, data.device).view(
        slots, seg_width)
    free = deque(range(len(pool)))
    last_send = {}  # (chunk, j) -> work: the gather phase must not overwrite data still in flight
    posted = deque()  # (pool buffer or None, work or None) per task, in task order

    def post(i: int) -> None:
        s, j = tasks[i]
        c = recv_chunk(s)
        target = seg[c][j]
        if not target.numel():
            posted.append((None, None))
            return
        if s < rs_steps:
            b = free.popleft()
            posted.append((b, peers.irecv(pool[b][: target.numel()], prv, 1 + i)))
        else:
            # A gather receive lands in a segment this rank sends (or sent) in the
            # reduce-scatter. If that send is out, let it finish first. With a wide window the
            # receive may be posted before the send is even issued; it is still safe, because
            # the final value that lands here is built from that very send: it cannot arrive
            # before the send has delivered its bytes.
            pending = last_send.pop((c, j), None)
            if pending is not None:
                pending.wait()
            posted.append((None, peers.irecv(target, prv, 1 + i)))

    def send(s: int, j: int) -> None:  # the tag is the task's index: 1 + s*k + j
        c = send_chunk(s)
        if seg[c][j].numel():
            last_send[(c, j)] = peers.isend(seg[c][j], nxt, 1 + s * k + j)

    def fill() -> None:  # keep up to `window` receives posted ahead, in task order
        nonlocal ahead
        while ahead < len(tasks) and len(posted) < window and (
                free or tasks[ahead][0] >= rs_steps):
            post(ahead)
            ahead += 1

    ahead = 0
    # Receives first, then the first sends, so that those find their receivers' buffers
    # announced (gloo holds a send back until they are). Measured interleaved against
    # sending first (4 ranks at 8-64 MiB, 3 ranks at 6-24 MiB): faster in 21 of 24
    # comparisons, by 2.5% in the median and up to 8%; it also took less CPU time per call in
    # all 9 runs that counted it (all ranks' threads, e.g. 48.0 against 50.2 ms at 16 MiB).
    fill()
    for j in range(k):
        send(0, j)
    for s, j in tasks:
        b, work = posted.popleft()
        if work is not None:
            work.wait()
            if s < rs_steps:
                target = seg[recv_chunk(s)][j]
                combine(target, pool[b][: target.numel()])
                free.append(b)
                if s == rs_steps - 1 and name == "avg":  # this segment is complete here
                    target.div_(p)
        if s + 1 < steps:  # pass the segment on first, then post more receives
            send(s + 1, j)
        fill()
    for w in last_send.values():
        w.wait()


def _pairs(offsets: list[int]) -> list[tuple[int, int]]:
    return list(zip(offsets[:-1], offsets[1:], strict=True))


def pair_all_reduce_(peers: Peers, data: torch.Tensor, name: str, segments: int) -> None:
    """In place on a 1-D tensor of 2 ranks: op over both, in `segments` messages per step.

    With p = 2 the ring is one exchange of halves: each rank sends the half the other will
    own, adds what it receives into its own half, then sends its finished half back. Cut into
    segments, a segment is added and sent back the moment it lands, while the next ones are
    still arriving, so the adds hide behind the transfer. Unlike the pipeline, nothing waits
    for a free buffer: every receive of the first exchange is posted at once, into one
    scratch half; a segment's receive in the second exchange lands in the half this rank
    sent first, so it is posted only once that segment's send is done. Chunks as bounds()
    cuts them (rank r owns chunk r), so the result is bit-identical to the ring's.
    """
    me, other = peers.me, 1 - peers.me
    off = bounds(data.numel(), 2)
    mine, theirs = data[off[me]:off[me + 1]], data[off[other]:off[other + 1]]
    box = scratch("ring-pair", mine.numel(), data.dtype, data.device)
    # The same cuts on both ranks: my j-th piece of `theirs` is the other's j-th of `mine`.
    mine_s, theirs_s, box_s = (t.tensor_split(segments) for t in (mine, theirs, box))
    combine = COMBINE[name]
    k = len(mine_s)
    recvs = [_post(peers.irecv, b, other, 1 + j) for j, b in enumerate(box_s)]
    sends = [_post(peers.isend, t, other, 1 + j) for j, t in enumerate(theirs_s)]
    back = []
    for j in range(k):
        if recvs[j] is not None:
            recvs[j].wait()
            combine(mine_s[j], box_s[j])
            if name == "avg":
                mine_s[j].div_(2)
        back.append(_post(peers.isend, mine_s[j], other, 1 + k + j))
        if sends[j] is not None:
            sends[j].wait()  # that piece of `theirs` is on its way: it may be overwritten now
        back.append(_post(peers.irecv, theirs_s[j], other, 1 + k + j))
    wait_all([w for w in back if w is not None])


def _post(call, tensor: torch.Tensor, peer: int, tag: int):
    """Start a send or receive, or nothing for an empty piece (both ranks skip it alike)."""
    return call(tensor, peer, tag) if tensor.numel() else None
