"""The ring's check carried in its first message (ring_carried.inline_ring_all_reduce_): on 2
gloo ranks, a tensor whose first chunk fits in INLINE_MAX_CHUNK bytes sends its header and
that chunk together. Results equal torch.distributed's (repeat calls included), the call
sends 2 messages instead of 3, and every mismatch it can meet (another size on either side of
the bound, another dtype or op, another collective whose data follows its agreement on the
same tag) is named on both ranks, with no rank aborted and the group still working.

This is the check where the ranks do not share memory (another host, or
MICRODDP_TRANSPORT=gloo, which every test here sets); where they do, the check is in shared
memory and the ring sends its first step at once (tests/test_ring_early.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import microddp
from errors_helpers import message
from microddp import collectives as C
from microddp.collectives import traffic
from microddp.collectives.agreement import carried as ring_carried
from microddp.collectives.agreement.agree import INLINE_MAX_CHUNK, PAIR_WORDS, SLOTS
from microddp.collectives.ring import ring
from microddp.comms import REDUCE_OPS

F32_BOUND = 2 * INLINE_MAX_CHUNK // 4  # float32 elements of the largest tensor sent inline


@pytest.fixture(autouse=True)
def _no_shared_memory(monkeypatch):
    """The ranks (spawned from this process, so they inherit it) talk through gloo only."""
    monkeypatch.setenv("MICRODDP_TRANSPORT", "gloo")


def _counting(module, name: str, calls: list):
    real = getattr(module, name)
    setattr(module, name, lambda *a, **k: (calls.append(name), real(*a, **k))[1])
    return real


def _equal(world) -> dict:
    ring.ring_all_reduce(torch.ones(2))  # settles the connections: checks are carried after
    calls: list = []
    real = _counting(ring, "inline_ring_all_reduce_", calls)
    g = torch.Generator().manual_seed(world.rank)
    cases = [(0, torch.float32, "sum"), (1, torch.float32, "sum"), (3, torch.float64, "avg"),
             (F32_BOUND - 1, torch.float32, "max"), (F32_BOUND, torch.float32, "avg"),
             (F32_BOUND + 2, torch.float32, "sum"), (F32_BOUND // 2, torch.float64, "product"),
             (F32_BOUND // 2 + 1, torch.float64, "sum"), (333, torch.bfloat16, "min"),
             (777, torch.int64, "sum"), (101, torch.complex64, "sum")]
    out = {}
    for n, dtype, op in cases:
        calls.clear()
        x = torch.randn(n, generator=g, dtype=torch.float64)
        x = (x * 100).to(dtype) if dtype == torch.int64 else x.to(dtype)
        rounds, y = [], x.clone()  # one tensor object for every round: its call is kept
        with traffic() as sent:
            for k in range(3):  # the first call sets up, the others are the kept call
                t = x + k
                ref = t.clone()
                dist.all_reduce(ref, REDUCE_OPS[op])
                if op == "avg":
                    ref /= 2
                y.copy_(t)
                C.ring_all_reduce(y, op)
                tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
                rounds.append(torch.allclose(y, ref, rtol=tol, atol=tol) if y.is_floating_point()
                              or y.is_complex() else torch.equal(y, ref))
        out[(n, str(dtype), op)] = {"equal": rounds, "inline": len(calls),
                                    "messages": sent.messages}
    ring.inline_ring_all_reduce_ = real
    return out


def test_small_tensors_go_inline_and_equal_torch():
    for rank, out in enumerate(microddp.launch.spawn(_equal, 2, timeout=120)):
        for (n, dtype, op), r in out.items():
            assert r["equal"] == [True] * 3, (rank, n, dtype, op, r)
            size = torch.empty(0, dtype=getattr(torch, dtype.split(".")[1])).element_size()
            chunk = -(-n // 2) * size
            inline = chunk <= INLINE_MAX_CHUNK
            assert r["inline"] == (3 if inline else 0), (rank, n, dtype, r)
            # Inline: the header with the first chunk, then the gather step (a rank whose own
            # chunk is empty sends nothing in it). Beside: the header, then both steps.
            mine = n // 2 if rank == 0 else n - n // 2  # bounds(): the later chunk is larger
            expect = (1 + (mine > 0)) if inline else 3
            assert r["messages"] == 3 * expect, (rank, n, dtype, r)


def _mismatches(world) -> dict:
    r = world.rank
    C.ring_all_reduce(torch.ones(2))
    kept = torch.ones(6)
    C.ring_all_reduce(kept)
    C.ring_all_reduce(kept)  # kept: a repeat runs the inline loop straight away
    small, large = F32_BOUND, 4 * F32_BOUND  # inline, and beside the data
    calls = {
        "small vs small shape": lambda: C.ring_all_reduce(torch.ones(small - r)),
        "small vs large shape": lambda: C.ring_all_reduce(torch.ones((small, large)[r])),
        "large vs small shape": lambda: C.ring_all_reduce(torch.ones((large, small)[r])),
        # the same shape, inline as float32, beside the data as float64
        "dtype across the bound": lambda: C.ring_all_reduce(
            torch.ones(small, dtype=(torch.float32, torch.float64)[r])),
        "op, kept": lambda: C.ring_all_reduce(kept, ("sum", "max")[r]),
        # tree_all_reduce sends its data on the agreement's tag, right after it
        "small ring vs tree": lambda: (C.ring_all_reduce, C.tree_all_reduce)[r](
            torch.ones(small)),
        "large ring vs tree": lambda: (C.ring_all_reduce, C.tree_all_reduce)[r](
            torch.ones(large)),
        "small ring vs broadcast": lambda: (C.ring_all_reduce(torch.ones(4)) if r == 0 else
                                            C.tree_broadcast(torch.ones(4), 0)),
        "small ring vs segmented": lambda: C.ring_all_reduce(
            torch.ones(small), segment_bytes=(None, 1024)[r]),
    }
    out = {name: message(call) for name, call in calls.items()}
    values = []
    for n in (small - 1, small, large, 4):  # nothing a refused call left posted lands here
        x = torch.full((n,), float(r + 1))
        C.ring_all_reduce(x)
        values.append(bool((x == 3.0).all()))
    C.ring_all_reduce(kept)
    out["after"], out["kept after"] = values, kept.tolist()
    return out


def test_every_mismatch_of_the_inline_check_is_named_on_both_ranks():
    for rank, out in enumerate(microddp.launch.spawn(_mismatches, 2, timeout=120)):
        for name in ("small vs small shape", "small vs large shape", "large vs small shape"):
            assert "ranks disagree on shape" in out[name], (rank, name, out[name])
        assert "ranks disagree on dtype" in out["dtype across the bound"], out
        assert "ranks disagree on op" in out["op, kept"], out["op, kept"]
        for name in ("small ring vs tree", "large ring vs tree", "small ring vs broadcast"):
            assert "the ranks of the group called different collectives" in out[name], \
                (rank, name, out[name])
        assert "ranks disagree on segment_bytes" in out["small ring vs segmented"], out
        assert out["after"] == [True] * 4 and out["kept after"] == [8.0] * 6, (rank, out)


def test_every_message_on_the_agreement_tag_has_one_size():
    """What makes a mismatched pair safe: an agreement's message, a header alone and a header
    with its chunk are equally long on 2 ranks (gloo aborts a process on unequal sizes)."""
    header = ring_carried.Header("ring_all_reduce", {"shape": (3,), "dtype": torch.float32,
                                                     "device": "cpu", "op": "sum"}, {})
    mine, theirs = header.payloads(torch.float64, INLINE_MAX_CHUNK // 8, 1)
    assert header.mine_t.numel() == header.theirs_t.numel() == PAIR_WORDS
    assert mine.numel() * 8 == INLINE_MAX_CHUNK  # the largest chunk fits exactly
    assert mine.data_ptr() - header.mine_t.data_ptr() == 8 * 2 * SLOTS
    assert theirs.data_ptr() - header.theirs_t.data_ptr() == 8 * 2 * SLOTS


def _sub_group(world) -> dict:
    """Ranks 1 and 2 of 3 as a group of 2: the inline path runs there too (rank 0, off the
    group, is skipped), equal to torch's, and a mismatch is named on both of its ranks."""
    group = dist.new_group([1, 2])
    out: dict = {}
    if world.rank != 0:
        _in_sub_group(world.rank, group, out)
    dist.barrier()  # rank 0 stays until the group is done with its connections
    return out


def _in_sub_group(rank: int, group, out: dict) -> None:
    r = rank - 1
    C.ring_all_reduce(torch.ones(2), group=group)  # settles this group's connections
    calls: list = []
    real = _counting(ring, "inline_ring_all_reduce_", calls)
    x = torch.arange(1001, dtype=torch.float32) * rank
    ref = x.clone()
    dist.all_reduce(ref, group=group)
    C.ring_all_reduce(x, group=group)
    out["equal"], out["inline"] = torch.equal(x, ref), len(calls)
    ring.inline_ring_all_reduce_ = real
    out["shape"] = message(lambda: C.ring_all_reduce(torch.ones(10 + r), group=group))
    after = torch.full((5,), float(rank))
    C.ring_all_reduce(after, group=group)
    out["after"] = after.tolist()


def test_a_two_rank_sub_group_goes_inline_too():
    out = microddp.launch.spawn(_sub_group, 3, timeout=120)
    assert out[0] == {}
    for rank in (1, 2):
        r = out[rank]
        assert r["equal"] and r["inline"] == 1, (rank, r)
        assert "ranks disagree on shape" in r["shape"], (rank, r["shape"])
        assert r["after"] == [3.0] * 5, (rank, r)
