"""Issue 56's send/recv row: a send and its receive that differ in size or dtype end in one
MicroDDPError on both ranks (gloo aborted the receiver, or half-filled a larger buffer, or read
another dtype's bytes), and the pair can go on talking on the same tag after. isend then
irecv on a ring, waited for in either order, still works (no header waits for a wait())."""

from __future__ import annotations

import torch

import microddp as mdp
from errors_helpers import message

# (what rank 0 sends, what rank 1 receives into, async)
CASES = {
    "larger message": (lambda: torch.ones(4), lambda: torch.zeros(3), False),
    "smaller message": (lambda: torch.ones(3), lambda: torch.zeros(4), False),
    "dtype, same bytes": (lambda: torch.ones(4), lambda: torch.zeros(4, dtype=torch.int32),
                          False),
    "dtype and size": (lambda: torch.ones(4), lambda: torch.zeros(3, dtype=torch.int32), True),
    "empty receive": (lambda: torch.ones(4), lambda: torch.zeros(0), True),
    "empty message": (lambda: torch.ones(0), lambda: torch.zeros(2), False),
}


def _pairs(world) -> dict[str, tuple[str, list]]:
    out = {}
    for name, (sent, into, async_) in CASES.items():
        if world.rank == 0:
            x = sent()
            said = message(lambda x=x, a=async_: mdp.comms.isend(x, 1, tag=5).wait() if a
                           else mdp.comms.send(x, 1, tag=5))
        else:
            x = into()
            said = message(lambda x=x, a=async_: mdp.comms.irecv(x, 0, tag=5).wait() if a
                           else mdp.comms.recv(x, 0, tag=5))
        # the same tag still carries the next message whole
        y = torch.full((3,), 7.0) if world.rank == 0 else torch.zeros(3)
        if world.rank == 0:
            mdp.comms.send(y, 1, tag=5)
        else:
            mdp.comms.recv(y, 0, tag=5)
        out[name] = (said, y.tolist())
    return out


def test_a_mismatched_send_and_receive_raise_on_both_ranks():
    ranks = mdp.spawn(_pairs, 2, timeout=90)
    for rank, results in enumerate(ranks):
        for name, (said, after) in results.items():
            assert "send/recv mismatch (tag 5): rank 0 sends " in said, (rank, name, said)
            assert "rank 1 receives " in said, (rank, name, said)
            assert after == [7.0, 7.0, 7.0], (rank, name, after)
    said = ranks[1]["dtype and size"][0]
    assert "rank 0 sends 4 elements of float32, rank 1 receives 3 elements of int32" in said
    assert ranks[0]["dtype and size"][0] == said  # the same words on both ranks


def _ring(world, sends_first: bool) -> list[float]:
    """Every rank isends to its right, irecvs from its left, then waits for both."""
    p, r = world.world_size, world.rank
    got = []
    for step in range(3):
        mine, theirs = torch.full((5,), float(10 * r + step)), torch.zeros(5)
        send = mdp.comms.isend(mine, (r + 1) % p, tag=1)
        recv = mdp.comms.irecv(theirs, (r - 1) % p, tag=1)
        for handle in ([send, recv] if sends_first else [recv, send]):
            handle.wait()
        got.append(theirs.tolist())
    return got


def _ring_both(world) -> tuple[list, list]:
    return _ring(world, True), _ring(world, False)


def test_isend_then_irecv_on_a_ring_completes_waited_in_either_order():
    p = 3
    ranks = mdp.spawn(_ring_both, p, timeout=90)
    for r, (sends_first, recvs_first) in enumerate(ranks):
        left = (r - 1) % p
        want = [[float(10 * left + step)] * 5 for step in range(3)]
        assert sends_first == want and recvs_first == want, (r, sends_first, recvs_first)


def _out_of_order(world) -> list:
    """Two isends on one tag waited for newest first: they still arrive in the order sent."""
    if world.rank == 0:
        a = mdp.comms.isend(torch.full((2,), 1.0), 1, tag=3)
        b = mdp.comms.isend(torch.full((4,), 2.0), 1, tag=3)
        b.wait()
        a.wait()
        mdp.comms.send(torch.full((3,), 3.0), 1, tag=4)
        return message(lambda: mdp.comms.send(torch.ones(3), 1, tag=4))
    x, y, z = torch.zeros(2), torch.zeros(4), torch.zeros(3)
    mdp.comms.recv(x, 0, tag=3)
    mdp.comms.recv(y, 0, tag=3)
    sender = mdp.comms.recv(z, tag=4)  # from any rank: the header names it
    said = message(lambda: mdp.comms.recv(torch.zeros(2, dtype=torch.int64), tag=4))
    return [x.tolist(), y.tolist(), z.tolist(), sender, said]


def test_sends_waited_out_of_order_arrive_in_the_order_made():
    ranks = mdp.spawn(_out_of_order, 2, timeout=60)
    assert ranks[1][:4] == [[1.0, 1.0], [2.0, 2.0, 2.0, 2.0], [3.0, 3.0, 3.0], 0], ranks
    want = "rank 0 sends 3 elements of float32, rank 1 receives 2 elements of int64"
    assert want in ranks[1][4] and want in ranks[0], ranks  # from any rank too
