"""ring_all_reduce picks its path by chunk size on gloo (see collectives/ring/loops.py): whole chunks
below a switch, segments from there on (on 2 ranks sharing one connection, MICRODDP_DUPLEX=0,
the pair loop's, from PAIR_MIN_CHUNK in PAIR_SEGMENT; on more, the pipeline's, from
PIPELINE_MIN_CHUNK in PIPELINE_SEGMENT). Each path must give torch.distributed's result; a
wrapper around the segmented loop shows which path ran, and the messages sent how many
segments it cut; the pipeline posts its receives before its first send. (2 ranks with a
connection per direction: tests/test_collectivestransport/duplex.py.)"""

import pytest
import torch
import torch.distributed as dist

import microddp as mdp
from microddp.collectives import ring_all_reduce, traffic
from microddp.collectives.ring import (
    PAIR_MIN_CHUNK,
    PAIR_SEGMENT,
    PIPELINE_MIN_CHUNK,
    PIPELINE_SEGMENT,
)

SWITCH = {2: (PAIR_MIN_CHUNK, PAIR_SEGMENT), 3: (PIPELINE_MIN_CHUNK, PIPELINE_SEGMENT)}


def around_the_switch(world):
    from microddp.collectives.ring import ring

    p = world.world_size
    g = torch.Generator().manual_seed(world.rank)
    at = SWITCH[p][0] // 4 * p  # float32 elements: chunks of exactly the switch's size
    out = {}
    # Which loop ran: the ring calls them through its own module's names.
    loop = {2: "pair_all_reduce_", 3: "pipelined_ring_all_reduce_"}[p]
    real, ran = getattr(ring, loop), []
    setattr(ring, loop, lambda *a, **k: (ran.append(1), real(*a, **k))[1])
    for label, numel, op in (("below", at - p, "sum"), ("at", at, "sum"), ("at", at, "avg"),
                             ("above", at + 2 * p + 1, "sum")):
        t = torch.randn(numel, generator=g)
        ref = t.clone()
        dist.all_reduce(ref)
        if op == "avg":
            ref /= p
        ran.clear()
        with traffic() as sent:
            ring_all_reduce(t, op, check=False)
        out[(label, op)] = {"equal": torch.allclose(t, ref, rtol=1e-6, atol=1e-6),
                            "messages": sent.messages, "segmented": bool(ran)}
    setattr(ring, loop, real)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_large_chunks_are_pipelined_and_equal_to_torch(world_size, monkeypatch):
    monkeypatch.setenv("MICRODDP_DUPLEX", "0")  # 2 ranks on one connection: the pair loop
    p = world_size
    switch, segment = SWITCH[p]
    segments = -(-switch // segment)
    for r in mdp.spawn(around_the_switch, p, timeout=120):
        assert all(v["equal"] for v in r.values()), r
        assert [v["segmented"] for v in r.values()] == [False, True, True, True], r
        assert r[("below", "sum")]["messages"] == 2 * (p - 1)  # one message per step
        assert r[("at", "sum")]["messages"] == 2 * (p - 1) * segments
        assert r[("at", "avg")]["messages"] == 2 * (p - 1) * segments
        # one element more per chunk than a whole number of segments: one more segment
        assert r[("above", "sum")]["messages"] == 2 * (p - 1) * (segments + 1)


def rhythms(world):
    """The benchmark's calibration chain, in every order the ring posts messages in."""
    from microddp.bench.allreduce import rhythm_plan, ring_rhythm
    from microddp.transport.duplex import duplex
    from microddp.transport.peers import Peers

    peers = duplex(Peers())  # on 2 ranks, a connection per direction: no effect on the count
    p, prv = world.world_size, (world.rank - 1) % world.world_size
    out = {}
    two = ("receive-first",) if p == 2 else ()  # an order only 2 ranks use
    for how in ("prepost", "lookahead", "plain", "pair", "pipeline", *two):
        a, inbox = torch.full((1000,), float(world.rank)), torch.full((2 * (p - 1), 1000), -1.0)
        with traffic() as sent:
            ring_rhythm(peers, rhythm_plan(p, a, inbox, how), how)
        out[how] = {"messages": sent.messages, "from_left": bool((inbox == prv).all())}
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_calibration_chain_follows_each_posting_order(world_size):
    from microddp.collectives.ring import PAIR_MIN_CHUNK, PREPOST_MAX_CHUNK, posting

    p = world_size
    for r in mdp.spawn(rhythms, p, timeout=60):
        assert r == dict.fromkeys(r, {"messages": 2 * (p - 1), "from_left": True}), r
        assert len(r) == (6 if p == 2 else 5)
    # the orders the ring picks, by chunk size and world size
    assert posting(PREPOST_MAX_CHUNK, 3) == "prepost"
    assert posting(PREPOST_MAX_CHUNK, 2) == "lookahead"  # two steps: only the gather's ahead
    assert posting(PREPOST_MAX_CHUNK + 4, 2) == "lookahead"
    assert posting(PREPOST_MAX_CHUNK + 4, 3) == "lookahead"
    assert posting(PAIR_MIN_CHUNK - 4, 2) == "lookahead"
    assert posting(PAIR_MIN_CHUNK, 2) == "pair"
    assert posting(64 << 20, 2) == "pair"  # on 2 ranks the pair loop, at any size
    assert posting(PIPELINE_MIN_CHUNK, 3) == "pipeline"
    assert posting(PIPELINE_MIN_CHUNK, 8) == "pipeline"
    assert posting(PIPELINE_MIN_CHUNK - 4, 3) == "lookahead"
    assert posting(4 << 20, 2, segment_bytes=1 << 20) == "pipeline"  # asked for: the pipeline
    # 2 ranks with a connection per direction: whole chunks, receives first, at any size
    for chunk in (4, PREPOST_MAX_CHUNK, PAIR_MIN_CHUNK, 64 << 20):
        assert posting(chunk, 2, duplex=True) == "receive-first"
    assert posting(4 << 20, 2, segment_bytes=1 << 20, duplex=True) == "pipeline"
    assert posting(4 << 20, 2, segment_bytes=4 << 20, duplex=True) == "receive-first"
    assert posting(PIPELINE_MIN_CHUNK, 3, duplex=True) == "pipeline"  # only 2 ranks have one


def batched(world):
    """The NCCL loop (`_batched_ring_all_reduce_`), run on gloo's batch_isend_irecv: no GPU
    here, but its steps and its division for avg are the same on either backend."""
    from microddp.collectives.ring.loops import _batched_ring_all_reduce_
    from microddp.collectives.ring.plan import make_plan
    from microddp.transport.peers import Peers

    peers = Peers()
    peers.nccl = True  # exchange() posts each step's pair as one batch, as on NCCL
    g = torch.Generator().manual_seed(world.rank)
    ok = {}
    for numel in (1, 1000, 4099):
        for op in ("sum", "avg", "max"):
            t = torch.randn(numel, generator=g)
            ref = t.clone()
            dist.all_reduce(ref, dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
            if op == "avg":
                ref /= world.world_size
            _batched_ring_all_reduce_(peers, make_plan(t, peers.size, peers.me), op)
            ok[(numel, op)] = torch.allclose(t, ref, rtol=1e-6, atol=1e-6)
    return ok


@pytest.mark.parametrize("world_size", [2, 3])
def test_nccl_loop_equals_torch_on_gloo(world_size):
    for r in mdp.spawn(batched, world_size, timeout=60):
        assert all(r.values()), r


class Logged:
    """Peers that note each send and receive, in the order the loop posts them."""

    def __init__(self, peers):
        self.peers, self.size, self.me, self.log = peers, peers.size, peers.me, []

    def isend(self, *args):
        self.log.append("send")
        return self.peers.isend(*args)

    def irecv(self, *args):
        self.log.append("recv")
        return self.peers.irecv(*args)


def pipeline_orders(world):
    from microddp.collectives.ring.loops import pipelined_ring_all_reduce_
    from microddp.transport.peers import Peers

    p, g = world.world_size, torch.Generator().manual_seed(world.rank)
    out = {}
    # 2 segments of 100 float32 per chunk: 2(p-1) steps of 2 messages; windows wide and narrow.
    for window in (64, 3):
        t = torch.randn(200 * p, generator=g)
        ref = t.clone()
        dist.all_reduce(ref)
        peers = Logged(Peers())
        pipelined_ring_all_reduce_(peers, t, "sum", 400, window)
        out[window] = {"equal": torch.allclose(t, ref, rtol=1e-6, atol=1e-6), "log": peers.log}
    return out


def test_pipeline_posts_its_receives_before_its_first_send():
    p = 3
    messages = 2 * (p - 1) * 2
    for r in mdp.spawn(pipeline_orders, p, timeout=60):
        assert all(v["equal"] for v in r.values()), r
        for window, v in r.items():
            log = v["log"]
            assert log.count("send") == log.count("recv") == messages, log
            # as many receives as the window (and the scratch slots) allow, then the sends
            first = min(window, messages)
            assert log[:first] == ["recv"] * first and log[first] == "send", (window, log)
