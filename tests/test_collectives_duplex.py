"""Two ranks on gloo, a connection per direction (transport/duplex.py): the ring's first call
on a 2-rank group opens a second group over the same ranks, messages from group rank 1 to 0
go over it and those from 0 to 1 over the group itself, results equal torch.distributed's,
one is opened per group (default group or sub-group) and freed with it, and
MICRODDP_DUPLEX=0 keeps one connection."""

import gc
import weakref

import pytest
import torch
import torch.distributed as dist

import microddp as mdp
from microddp.collectives import ring_all_reduce, traffic
from microddp.collectives.ring import PAIR_MIN_CHUNK, PAIR_SEGMENT
from microddp.comms import REDUCE_OPS
from microddp.transport import duplex as _duplex
from microddp.transport.duplex import open_duplexes


class Counting:
    """A process group stand-in that counts the sends and receives passed on to it."""

    def __init__(self, pg):
        self.pg, self.sends, self.recvs = pg, 0, 0

    def send(self, *args):
        self.sends += 1
        return self.pg.send(*args)

    def recv(self, *args):
        self.recvs += 1
        return self.pg.recv(*args)


def _equal_to_torch(t: torch.Tensor, op: str, group=None, **kw) -> bool:
    ref = t.clone()
    dist.all_reduce(ref, REDUCE_OPS[op], group=group)
    if op == "avg":
        ref /= 2
    ring_all_reduce(t, op, group, **kw)
    return torch.allclose(t, ref, rtol=1e-6, atol=1e-6)


def default_group(world):
    from microddp.collectives.ring import ring

    g = torch.Generator().manual_seed(world.rank)
    hows = []  # the message order of each call the ring runs (kept calls included)
    real = ring.planned_ring_all_reduce_
    ring.planned_ring_all_reduce_ = lambda *a, **k: (hows.append(k.get("how")), real(*a, **k))[1]
    out = {"before": open_duplexes()}
    out["first"] = _equal_to_torch(torch.randn(1001, generator=g), "sum")
    out["opened"] = open_duplexes()
    pg = dist.group.WORLD
    counting = _duplex._backs[pg] = Counting(_duplex._backs[pg])  # count what goes over it
    # Around the size where one connection switches to the pair loop, and the small and odd.
    numels = (0, 1, 3, PAIR_MIN_CHUNK // 2 - 1, PAIR_MIN_CHUNK // 2, PAIR_MIN_CHUNK // 2 + 5)
    cases = [(n, op) for n in numels for op in ("sum", "avg", "max")]
    out["equal"], out["messages"] = {}, {}
    x = torch.randn(4096, generator=g)
    with traffic() as total:
        for n, op in cases:
            with traffic() as sent:
                out["equal"][(n, op)] = _equal_to_torch(torch.randn(n, generator=g), op,
                                                        check=False)
            out["messages"][(n, op)] = sent.messages
        out["repeats"] = [_equal_to_torch(x, "sum", check=False) for _ in range(3)]  # kept
    out["sent"] = total.messages
    out["back"] = (counting.sends, counting.recvs)
    out["still"] = open_duplexes()
    out["hows"] = set(hows)
    # Freed with the default group once nothing holds it (the world is set up anew after).
    second = weakref.ref(counting.pg)
    _duplex._backs[pg] = counting.pg  # the real one back in place of the stand-in
    del pg, counting
    gc.collect()
    out["alive while the group lives"] = second() is not None
    mdp.shutdown()
    gc.collect()
    out["freed with the group"] = second() is None
    return out


def test_two_ranks_open_one_second_connection_and_route_one_direction_over_it():
    r0, r1 = mdp.spawn(default_group, 2, timeout=180)
    for r in (r0, r1):
        assert r["before"] == 0 and r["opened"] == 1 and r["still"] == 1
        assert r["first"] and all(r["equal"].values()) and all(r["repeats"]), r
        # whole chunks at every size, even where one connection would cut them in segments
        # (one element: only one chunk holds anything)
        assert r["messages"] == {(n, op): min(n, 2) for n, op in r["messages"]}, r["messages"]
        assert r["hows"] == {"receive-first"}, r["hows"]
        assert r["alive while the group lives"] and r["freed with the group"], r
    # Every message from rank 1 to rank 0 went over the second connection, and only those.
    assert r1["sent"] > 0 and r1["back"] == (r1["sent"], 0), r1
    assert r0["back"] == (0, r1["sent"]), (r0, r1)


def sub_group(world):
    g = torch.Generator().manual_seed(world.rank)
    pair = dist.new_group([0, 2])
    out = {"member": world.rank in (0, 2)}
    if out["member"]:
        out["equal"] = [_equal_to_torch(torch.randn(n, generator=g), "sum", pair)
                        for n in (5, 100_001)]
    out["opened"] = open_duplexes()
    # Three ranks on the default group: a true ring, no second connection needed
    out["world"] = _equal_to_torch(torch.randn(999, generator=g), "sum")
    out["opened after world"] = open_duplexes()
    if out["member"]:
        back = weakref.ref(_duplex._backs[pair])
        dist.destroy_process_group(pair)
        del pair
        gc.collect()
        out["freed"] = back() is None and open_duplexes() == 0
    return out


def test_a_two_rank_sub_group_gets_its_own_and_frees_it_with_the_group():
    for rank, r in enumerate(mdp.spawn(sub_group, 3, timeout=180)):
        if rank == 1:
            assert not r["member"] and r["opened"] == 0 and r["opened after world"] == 0
        else:
            assert r["equal"] == [True, True] and r["opened"] == 1, r
            assert r["opened after world"] == 1 and r["freed"], r
        assert r["world"]


def one_connection(world):
    g = torch.Generator().manual_seed(world.rank)
    big = PAIR_MIN_CHUNK // 2  # float32 elements: chunks at the pair loop's switch
    with traffic() as sent:
        ok = [_equal_to_torch(torch.randn(n, generator=g), "sum", check=False)
              for n in (7, big)]
    return {"ok": ok, "opened": open_duplexes(), "messages": sent.messages}


@pytest.mark.parametrize("value", ["0", "off"])
def test_duplex_off_keeps_one_connection(monkeypatch, value):
    monkeypatch.setenv("MICRODDP_DUPLEX", value)
    for r in mdp.spawn(one_connection, 2, timeout=180):
        assert r["ok"] == [True, True] and r["opened"] == 0, r
        # 2 whole steps, then the pair loop's 2 steps in PAIR_SEGMENT pieces
        assert r["messages"] == 2 + 2 * PAIR_MIN_CHUNK // PAIR_SEGMENT, r


def mismatched(world):
    import os

    os.environ["MICRODDP_DUPLEX"] = "0" if world.rank == 0 else "1"
    try:
        ring_all_reduce(torch.ones(10))
    except mdp.MicroDDPError as e:
        return str(e)
    return "no error"


def test_ranks_that_disagree_on_duplex_get_a_clear_error_not_a_hang():
    for rank, message in enumerate(mdp.spawn(mismatched, 2, timeout=60)):
        assert "disagree on MICRODDP_DUPLEX" in message, message
        assert f"MICRODDP_DUPLEX={rank}" in message, message  # each rank's own setting


def _port_rank(rank: int, port: int, results) -> None:
    """A user's script: init from MASTER_PORT (rank 0 serves the store on it), ring, shut
    down. The second connection holds the group's store; if it outlived the group, the port
    would stay bound and a new world could not start on it."""
    import os
    import socket

    from microddp.launch.procs import die_with_parent

    die_with_parent()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    mdp.init(backend="gloo", timeout=30)
    t = torch.full((1000,), rank + 1.0)
    ring_all_reduce(t)
    ring_all_reduce(t, check=False)
    out = [float(t[0]), open_duplexes()]
    dist.barrier()  # both done with the store before rank 0 takes it down
    mdp.shutdown()  # no gc.collect(): freed as soon as the group is
    out.append(open_duplexes())
    if rank == 0:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))  # refused while a store still listens on it
                out.append("port free")
            except OSError as e:
                out.append(f"port still bound: {e}")
    results.put((rank, out))


def test_shutdown_frees_the_store_port():
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_port_rank, args=(r, port, results), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert got == {0: [6.0, 1, 0, "port free"], 1: [6.0, 1, 0]}, got
