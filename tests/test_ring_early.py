"""The ring's check in shared memory, with its first step sent before the check is read
(agreement/early.py, shm/agreement.py, transport/sized_tags.py): on 2 gloo ranks of one host, the default.

Results equal torch's; the check sends no message of its own (the checked call sends what the
unchecked one does); every message on a sized tag has exactly the size its tag stands for,
refused calls included; every mismatch that can meet an early step (another size with one
sized tag shared or none, the same bytes in another dtype, another op on a kept call, a
1-element call that cannot go early, another collective's agreement) is named on both
ranks, no process aborts, and later calls of the very sizes the refused ones used get the
right sums. Agreements of 3 ranks through shared memory, back to back, with mismatches,
and the same check where no memory is shared (MICRODDP_TRANSPORT=gloo: none of this)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import microddp
from errors_helpers import message
from microddp import collectives as C
from microddp.collectives.agreement import agree
from microddp.collectives.ring import ring
from microddp.shm import agreement as shm_agree
from microddp.transport import sized_tags
from microddp.transport.peers import Peers

N = 3000  # float32 elements: chunks of 6 KB, past any inline bound


def _record_sized_messages(sizes: list):
    """Wrap Peers.isend/irecv so every message on a sized tag records (tag, bytes)."""
    real = Peers.isend, Peers.irecv

    def wrap(fn):
        def call(self, tensor, peer, tag=0):
            if tag >= sized_tags.SIZED_BASE:
                sizes.append((tag, tensor.numel() * tensor.element_size()))
            return fn(self, tensor, peer, tag)
        return call

    Peers.isend, Peers.irecv = wrap(real[0]), wrap(real[1])
    return real


def _early(world) -> dict:
    r = world.rank
    C.ring_all_reduce(torch.ones(2))  # settles the connections: calls go early after
    out: dict = {"equal": [], "shared": agree.shared_agreement(Peers()) is not None}
    early_calls: list = []
    real_loop = ring.early_ring_all_reduce_
    ring.early_ring_all_reduce_ = lambda *a, **k: (early_calls.append(1), real_loop(*a, **k))
    sizes: list = []
    real = _record_sized_messages(sizes)
    g = torch.Generator().manual_seed(r)
    y = torch.empty(N + 3)  # one tensor for every round: its call is kept after the first
    for op in ("sum", "avg", "max", "sum", "product"):
        x = torch.randn(N + 3, generator=g)
        ref = x.clone()
        dist.all_reduce(ref, {"avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
                              "product": dist.ReduceOp.PRODUCT}.get(op, dist.ReduceOp.SUM))
        y.copy_(x)
        C.ring_all_reduce(y, op)
        out["equal"].append(torch.allclose(y, ref, rtol=1e-6, atol=1e-6))
    out["early calls"], out["early messages"] = len(early_calls), len(sizes)
    with C.traffic() as checked:
        C.ring_all_reduce(y)
    with C.traffic() as unchecked:
        C.ring_all_reduce(y, check=False)
    out["messages"] = (checked.messages, unchecked.messages)
    kept = torch.ones(N)
    C.ring_all_reduce(kept)
    calls = {
        # 3000 vs 3001 elements: one sized tag shared (1500 x 4 bytes), one not
        "shape, one tag shared": lambda: C.ring_all_reduce(torch.ones(N + r)),
        "shape, no tag shared": lambda: C.ring_all_reduce(torch.ones(N + 64 * r)),
        "dtype, same bytes": lambda: C.ring_all_reduce(
            torch.ones(N, dtype=(torch.float32, torch.int32)[r])),
        "op, kept": lambda: C.ring_all_reduce(kept, ("sum", "max")[r]),
        "early vs one element": lambda: C.ring_all_reduce(torch.ones((N, 1)[r])),
        "one element vs early": lambda: C.ring_all_reduce(torch.ones((1, N)[r])),
        "early vs tree": lambda: (C.ring_all_reduce, C.tree_all_reduce)[r](torch.ones(N)),
        "broadcast vs early": lambda: (C.tree_broadcast(torch.ones(N), 0) if r == 0 else
                                       C.ring_all_reduce(torch.ones(N))),
    }
    for name, call in calls.items():
        out[name] = message(call)
    # Refused calls back to back, both ranks arriving about together: none may hang
    out["refusals in a row"] = sum(
        "ranks disagree on shape" in message(lambda: C.ring_all_reduce(torch.ones(N + r)))
        for _ in range(200))
    values = []
    for n in (N, N + 1, N + 64, 1):  # every size a refused call used early
        for dtype in (torch.float32, torch.int32):
            x = torch.full((n,), r + 1, dtype=dtype)
            C.ring_all_reduce(x)
            values.append(bool((x == 3).all()))
    C.ring_all_reduce(kept)
    out["after"], out["kept after"] = values, bool((kept == 4).all())
    Peers.isend, Peers.irecv = real
    ring.early_ring_all_reduce_ = real_loop
    out["sizes"] = sizes
    return out


def test_the_early_first_step_equals_torch_and_every_mismatch_is_named():
    for rank, out in enumerate(microddp.launch.spawn(_early, 2, timeout=180)):
        assert out["shared"], out  # the default on one host: the check in shared memory
        assert out["equal"] == [True] * 5, (rank, out["equal"])
        # the first call of a tensor sets up, then goes early; every later one is kept
        assert out["early calls"] == 5 and out["early messages"] == 5 * 2, out
        assert out["messages"] == (2, 2), out  # the check adds no message
        for name in ("shape, one tag shared", "shape, no tag shared", "early vs one element",
                     "one element vs early"):
            assert "ranks disagree on shape" in out[name], (rank, name, out[name])
        assert "ranks disagree on dtype" in out["dtype, same bytes"], out
        assert "ranks disagree on op" in out["op, kept"], out["op, kept"]
        for name in ("early vs tree", "broadcast vs early"):
            assert "the ranks of the group called different collectives" in out[name], \
                (rank, name, out[name])
        assert out["refusals in a row"] == 200, out["refusals in a row"]
        assert out["after"] == [True] * 8 and out["kept after"], (rank, out)
        bad = [(tag, n) for tag, n in out["sizes"] if n != tag - sized_tags.SIZED_BASE]
        assert out["sizes"] and not bad, (rank, bad)


def _three(world) -> dict:
    """Agreements of 3 ranks in shared memory, back to back: matching calls and mismatches
    mixed, so each parity of the mailbox is written again while others read the last one."""
    r = world.rank
    out = {"shared": agree.shared_agreement(Peers()) is not None, "errors": [], "sums": []}
    for i in range(300):
        odd = i % 7 == 3 and r == 2  # rank 2 passes another shape now and then
        x = torch.full((5 + odd,), float(r))
        err = message(lambda x=x: C.tree_all_reduce(x))
        out["errors"].append(err != "no error")
        if err == "no error":
            out["sums"].append(x.tolist() == [3.0] * 5)
    y = torch.ones(N)
    for _ in range(3):
        C.ring_all_reduce(y)
    out["ring"] = bool((y == 27).all())
    return out


def test_three_ranks_agree_in_shared_memory_back_to_back():
    results = microddp.launch.spawn(_three, 3, timeout=180)
    wanted = [i % 7 == 3 for i in range(300)]
    for out in results:
        assert out["shared"]
        assert out["errors"] == wanted  # every rank refuses exactly the mismatched calls
        assert all(out["sums"]) and len(out["sums"]) == wanted.count(False)
        assert out["ring"]


def _transport_gloo(world) -> bool:
    return agree.shared_agreement(Peers()) is None


def test_no_shared_memory_no_shared_agreement(monkeypatch):
    monkeypatch.setenv("MICRODDP_TRANSPORT", "gloo")
    assert all(microddp.launch.spawn(_transport_gloo, 2, timeout=60))


def test_the_mailbox_holds_what_an_agreement_sends():
    # shm_agree cannot import agree (agree imports it): its literal is checked here
    assert shm_agree.WORDS == 2 * agree.SLOTS


def test_a_post_wakes_a_peer_only_when_it_said_it_sleeps(monkeypatch):
    """shm/segment.py: a post makes the futex system call only when another rank raised its
    asleep flag (set by a wait before its last look, behind a fence); otherwise none."""
    import os

    from microddp.shm import segment as shm

    assert shm._fence_call is not None  # the fence is a libc call here, not a system call
    shm.fence()
    name = shm.segment_name()
    seg = shm.Segment(name, 4096, create=True)
    seg.unlink()
    try:
        pids = [os.getpid()] * 2
        mine, theirs = shm.Flags(seg, 0, 0, 2, pids), shm.Flags(seg, 0, 1, 2, pids)
        woken: list = []
        monkeypatch.setattr(shm, "_futex_wake", lambda address: woken.append(address))
        mine.post(1)
        assert woken == [] and theirs.get(0) == 1  # nobody asleep: no system call
        seg.words[theirs.index[1] + shm._ASLEEP] = 1  # rank 1 is about to sleep on a bell
        mine.post(2)
        assert len(woken) == 1  # rank 0's bell is rung for it
        theirs.wait(2, 1.0, "test")  # already posted: returns at once, flag untouched
    finally:
        seg.close()


def test_agrees_says_yes_only_when_every_rank_posted_the_same_numbers():
    """shm_agree.SharedAgreement.agrees, the early ring's answer without a wait: True only
    once the other rank posted this very agreement with equal numbers (the extra words aside);
    the numbers of the previous agreement, or other numbers, are not a yes."""
    import array
    import os

    from microddp.shm import segment as shm

    seg = shm.Segment(shm.segment_name(), 8 * shm_agree.area_words(2) + 64, create=True)
    seg.unlink()
    try:
        pids = [os.getpid()] * 2
        a, b = (shm_agree.SharedAgreement(seg, 0, r, 2, pids, None, 1.0) for r in (0, 1))
        same = array.array("q", range(shm_agree.WORDS))
        other = array.array("q", [7] * shm_agree.WORDS)
        seq = a.post(same, (5, 6))
        assert a.agrees(seq, same) is None  # rank 1 has not posted agreement 1
        assert b.post(same, (6, 5)) == seq and a.agrees(seq, same) and b.agrees(seq, same)
        seq = a.post(same)
        assert a.agrees(seq, same) is None  # rank 1's post of agreement 1 does not count for 2
        b.post(other)
        assert a.agrees(seq, same) is False and b.agrees(seq, other) is False
        assert a.result(seq, same, "test") == [max(x, 7) for x in same]  # a butterfly's max
        assert b.extra(1, 0) == (5, 6) and a.extra(seq, 1) == (0, 0)
        seq = a.post(same)  # agreement 3 uses agreement 1's lines, where rank 1 wrote `same`
        assert a.agrees(seq, same) is None  # but rank 1's counter says 2: not posted yet
        b.post(same)
        assert a.agrees(seq, same) is True
        b.post(other)  # rank 1 is one agreement ahead (4, the other set of lines): 3 still
        assert a.agrees(seq, same) is True  # agreed, its lines untouched
    finally:
        seg.close()


def _kept_without_duplex(world) -> list:
    from microddp.collectives.ring.plan import recall

    t = torch.ones(N)
    out = []
    for _ in range(3):  # the first call settles the connections; the second is kept
        C.ring_all_reduce(t)
        out.append(recall(t, "sum", None, True) is not None)
    out.append(bool((t == 8).all()))
    return out


def test_repeat_checked_calls_are_kept_on_one_connection_too(monkeypatch):
    """MICRODDP_DUPLEX=0: no early step (it needs a connection per direction), the check in
    shared memory first, and a repeat call still runs its kept loop (ring/plan.py)."""
    monkeypatch.setenv("MICRODDP_DUPLEX", "0")
    for out in microddp.launch.spawn(_kept_without_duplex, 2, timeout=60):
        assert out == [False, True, True, True], out
