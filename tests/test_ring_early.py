"""The ring's first step sent beside its header, before the check has come back
(ring_carried.py, sized_tags.py): on 2 gloo ranks, for tensors whose first chunk is past
INLINE_MAX_CHUNK. What makes it safe is that every message on a sized tag has exactly the
size the tag stands for; what makes it clean is that a refused call leaves nothing on those
tags. Here: results equal torch's; the size rule holds for every message, refused calls
included; every mismatch that meets an early step (another size with some tags shared and
some not, the same bytes in another dtype, another op, an inline header, another
collective's agreement) is named on both ranks, no process aborts, and the calls after, of
the very sizes the refused ones used, get the right sums."""

from __future__ import annotations

import torch
import torch.distributed as dist

import microddp
from errors_helpers import message
from microddp import collectives as C
from microddp.collectives import sized_tags
from microddp.collectives.agree import INLINE_MAX_CHUNK
from microddp.transport.peers import Peers

LARGE = 4 * INLINE_MAX_CHUNK // 4  # float32 elements: chunks of 2x INLINE_MAX_CHUNK, early


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
    C.ring_all_reduce(torch.ones(2))  # settles the connections: checks are carried after
    sizes: list = []
    real = _record_sized_messages(sizes)
    out: dict = {"equal": []}
    g = torch.Generator().manual_seed(r)
    y = torch.empty(LARGE + 3)  # one tensor for every round: its call is kept after the first
    for op in ("sum", "avg", "max", "sum"):
        x = torch.randn(LARGE + 3, generator=g)
        ref = x.clone()
        dist.all_reduce(ref, dist.ReduceOp.AVG if op == "avg" else
                        dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        y.copy_(x)
        C.ring_all_reduce(y, op)
        out["equal"].append(torch.allclose(y, ref, rtol=1e-6, atol=1e-6))
    out["early messages"] = len(sizes)
    kept = torch.ones(LARGE)
    C.ring_all_reduce(kept)
    calls = {
        # 2048 vs 2048 and 2048 vs 2049 elements: one sized tag shared, one not
        "shape, one tag shared": lambda: C.ring_all_reduce(torch.ones(LARGE + r)),
        "shape, no tag shared": lambda: C.ring_all_reduce(torch.ones(LARGE + 64 * r)),
        "dtype, same bytes": lambda: C.ring_all_reduce(
            torch.ones(LARGE, dtype=(torch.float32, torch.int32)[r])),
        "op, kept": lambda: C.ring_all_reduce(kept, ("sum", "max")[r]),
        "early vs inline": lambda: C.ring_all_reduce(torch.ones((LARGE, 8)[r])),
        "inline vs early": lambda: C.ring_all_reduce(torch.ones((8, LARGE)[r])),
        "early vs tree": lambda: (C.ring_all_reduce, C.tree_all_reduce)[r](torch.ones(LARGE)),
        "broadcast vs early": lambda: (C.tree_broadcast(torch.ones(LARGE), 0) if r == 0 else
                                       C.ring_all_reduce(torch.ones(LARGE))),
    }
    for name, call in calls.items():
        out[name] = message(call)
    values = []
    for n in (LARGE, LARGE + 1, LARGE + 64, 8):  # every size a refused call used early
        for dtype in (torch.float32, torch.int32):
            x = torch.full((n,), r + 1, dtype=dtype)
            C.ring_all_reduce(x)
            values.append(bool((x == 3).all()))
    C.ring_all_reduce(kept)
    out["after"], out["kept after"] = values, bool((kept == 4).all())
    Peers.isend, Peers.irecv = real
    out["sizes"] = sizes
    return out


def test_the_early_first_step_equals_torch_and_every_mismatch_is_named():
    for rank, out in enumerate(microddp.launch.spawn(_early, 2, timeout=120)):
        assert out["equal"] == [True] * 4, (rank, out["equal"])
        assert out["early messages"] == 4 * 2, out  # each call's first send and receive
        for name in ("shape, one tag shared", "shape, no tag shared", "early vs inline",
                     "inline vs early"):
            assert "ranks disagree on shape" in out[name], (rank, name, out[name])
        assert "ranks disagree on dtype" in out["dtype, same bytes"], out
        assert "ranks disagree on op" in out["op, kept"], out["op, kept"]
        for name in ("early vs tree", "broadcast vs early"):
            assert "the ranks of the group called different collectives" in out[name], \
                (rank, name, out[name])
        assert out["after"] == [True] * 8 and out["kept after"], (rank, out)
        bad = [(tag, n) for tag, n in out["sizes"] if n != tag - sized_tags.SIZED_BASE]
        assert out["sizes"] and not bad, (rank, bad)


def test_a_sized_tag_stands_for_its_size_within_gloos_range():
    assert sized_tags.sized_tag(0) is None
    assert sized_tags.sized_tag(1) == sized_tags.SIZED_BASE + 1
    top = sized_tags.sized_tag(sized_tags.SIZED_MAX_BYTES)
    assert top == 2**31 - 1  # the largest tag gloo accepts
    assert sized_tags.sized_tag(sized_tags.SIZED_MAX_BYTES + 1) is None
