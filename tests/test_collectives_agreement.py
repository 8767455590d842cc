"""Ranks that do not call the same thing: a different collective, a different segment size,
something that is not a tensor. Every rank gets a clear MicroDDPError (never a hang, never a
process killed by gloo), and the group still works afterwards. Also: results that must be the
same bits on every rank, and outputs that alias inputs."""

from __future__ import annotations

import pytest
import torch

import microddp
from errors_helpers import message
from microddp import collectives as C
from microddp.shm.verdict import code as _code

PAIRS = {  # what rank 0 calls, what the others call
    "ring vs tree": (lambda t: C.ring_all_reduce(t), lambda t: C.tree_all_reduce(t)),
    "naive vs tree": (lambda t: C.naive_all_reduce(t), lambda t: C.tree_all_reduce(t)),
    "broadcast vs reduce": (lambda t: C.tree_broadcast(t, 0), lambda t: C.tree_reduce(t, 0)),
    "segment sizes": (lambda t: C.ring_all_reduce(t, segment_bytes=4096),
                      lambda t: C.ring_all_reduce(t, segment_bytes=8192)),
    "segmented vs whole": (lambda t: C.ring_all_reduce(t, segment_bytes=4096),
                           lambda t: C.ring_all_reduce(t)),
    "no tensor": (lambda t: C.ring_all_reduce(t.tolist()), lambda t: C.ring_all_reduce(t)),
    "bad segment size": (lambda t: C.ring_all_reduce(t, segment_bytes=0),
                         lambda t: C.ring_all_reduce(t)),
    "no output tensor": (lambda t: C.ring_reduce_scatter(None, [t, t]),
                         lambda t: C.ring_reduce_scatter(torch.empty(4096), [t, t])),
}


def _different_calls(world, settled: bool) -> dict:
    out = {}
    if settled:  # after a first ring call, 2 ranks carry the ring's check beside its data
        C.ring_all_reduce(torch.ones(2))
    for name, (first, other) in PAIRS.items():
        call = first if world.rank == 0 else other
        # 16 KiB: segments of 4 KiB or 8 KiB give messages of different sizes
        out[name] = message(lambda call=call: call(torch.ones(4096)))
    after = torch.full((3,), float(world.rank))
    C.ring_all_reduce(after)  # the group still works
    out["after"] = after.tolist()
    return out


# Where the ranks share memory (the default here) the checks meet there (shm/agreement.py, and the
# ring's early first step, agreement/early.py); with MICRODDP_TRANSPORT=gloo, in gloo messages
# (agree.py's butterfly, the ring's carried header, agreement/carried.py). Both must name it all.
TRANSPORTS = ["auto", "gloo"]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("settled", [False, True])
def test_ranks_calling_different_things_all_get_a_clear_error(settled, transport, monkeypatch):
    monkeypatch.setenv("MICRODDP_TRANSPORT", transport)
    for rank, out in enumerate(microddp.launch.spawn(_different_calls, 2, (settled,), timeout=120)):
        for name in ("ring vs tree", "naive vs tree", "broadcast vs reduce"):
            assert "the ranks of the group called different collectives" in out[name], (rank, out)
        for name in ("segment sizes", "segmented vs whole"):
            assert "ranks disagree on segment_bytes" in out[name], (rank, out[name])
        mine = {"no tensor": "must be a torch.Tensor, got list",
                "bad segment size": "segment_bytes must be positive, got 0",
                "no output tensor": "output must be a torch.Tensor, got NoneType"}
        for name, own in mine.items():
            assert own in out[name] if rank == 0 else \
                "another rank of the group rejected its arguments" in out[name], (rank, out[name])
        assert out["after"] == [1.0, 1.0, 1.0]


def _carried_mismatches(world) -> dict:
    """On 2 ranks, once a ring call has settled the connections, the check travels beside the
    data (agreement/carried.py), or goes through shared memory beside the early first step
    (agreement/early.py): every mismatch is still named, on both ranks, including on a tensor whose
    call is kept (ring/plan.py), and nothing left posted by a refused call lands anywhere."""
    r = world.rank
    C.ring_all_reduce(torch.ones(2))
    kept = torch.ones(6)
    C.ring_all_reduce(kept)
    C.ring_all_reduce(kept)  # the kept call
    calls = {
        "shape": lambda: C.ring_all_reduce(torch.ones(4 + r)),
        "dtype": lambda: C.ring_all_reduce(torch.ones(4, dtype=(torch.float32,
                                                                 torch.float64)[r])),
        "op": lambda: C.ring_all_reduce(torch.ones(4), ("sum", "max")[r]),
        "op, kept": lambda: C.ring_all_reduce(kept, ("sum", "max")[r]),
        "ring vs naive": lambda: (C.ring_all_reduce, C.naive_all_reduce)[r](torch.ones(4)),
        "ring vs broadcast": lambda: (C.ring_all_reduce(torch.ones(4)) if r == 0 else
                                      C.tree_broadcast(torch.ones(4), 0)),
        # the connections are settled: a change of MICRODDP_DUPLEX on one rank changes nothing
        # (the check holds the settled value), on a new tensor and on a kept one alike
        "duplex, settled": lambda: _with_duplex(("1", "0")[r], lambda: (
            C.ring_all_reduce(torch.ones(4)), C.ring_all_reduce(kept))),
        "bad segment size": lambda: C.ring_all_reduce(torch.ones(4),
                                                      segment_bytes=(None, 0)[r]),
    }
    out = {name: message(call) for name, call in calls.items()}
    values = []
    for n in (4, 5, 4 + r):  # the same sizes the refused calls left receives posted for
        x = torch.full((min(n, 4),), float(r + 1))
        C.ring_all_reduce(x)
        values.append(x.tolist())
    C.ring_all_reduce(kept)
    out["after"], out["kept after"] = values, kept.tolist()
    return out


def _with_duplex(value: str, fn):
    import os

    old = os.environ.get("MICRODDP_DUPLEX")
    os.environ["MICRODDP_DUPLEX"] = value
    try:
        return fn()
    finally:
        os.environ.pop("MICRODDP_DUPLEX") if old is None else os.environ.update(
            MICRODDP_DUPLEX=old)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_check_carried_beside_the_data_names_every_mismatch(transport, monkeypatch):
    monkeypatch.setenv("MICRODDP_TRANSPORT", transport)
    for rank, out in enumerate(microddp.launch.spawn(_carried_mismatches, 2, timeout=120)):
        assert f"ranks disagree on shape (this rank, group rank {rank}: shape=({4 + rank},)" \
            in out["shape"], out["shape"]
        assert "ranks disagree on dtype" in out["dtype"], out["dtype"]
        assert "ranks disagree on op" in out["op"] and "ranks disagree on op" in out["op, kept"]
        for name in ("ring vs naive", "ring vs broadcast"):
            assert "the ranks of the group called different collectives" in out[name], out[name]
        assert out["duplex, settled"] == "no error", out["duplex, settled"]
        assert ("segment_bytes must be positive, got 0" if rank == 1 else
                "another rank of the group rejected its arguments") in out["bad segment size"]
        assert out["after"] == [[3.0] * 4] * 3 and out["kept after"] == [16.0] * 6, out


def _signed_zeros(world) -> list:
    t = torch.tensor([0.0, -0.0]) if world.rank == 0 else torch.tensor([-0.0, 0.0])
    out = []
    for op in ("min", "max"):
        x = t.clone()
        C.tree_all_reduce(x, op)
        out.append(torch.signbit(x).tolist())
    return out


@pytest.mark.parametrize("p", [2, 3])
def test_tree_min_and_max_give_every_rank_the_same_bits(p):
    results = microddp.launch.spawn(_signed_zeros, p, timeout=60)
    assert all(r == results[0] for r in results)  # min(0.0, -0.0) depends on argument order


def _aliased(world) -> dict:
    p, r = world.world_size, world.rank
    mine = torch.full((4,), float(r))
    # scatter: the root's own output is also the part it sends to rank 1
    out = torch.full((4,), 7.0)
    parts = [torch.full((4,), float(i)) for i in range(p)]
    if r == 0:
        parts[1] = out
    C.scatter(out, parts if r == 0 else None, 0)
    scattered = out.tolist()
    # gather: the root's input is also where rank 1's part lands
    g = None
    if r == 0:
        g = [torch.empty(4) for _ in range(p)]
        g[1] = mine
    C.gather(mine, g, dst=0)
    gathered = [t.tolist() for t in g] if r == 0 else None
    # an output whose elements overlap in memory cannot hold a result
    overlapping = torch.zeros(10).as_strided((2, 2), (1, 1))
    refused = message(lambda: C.tree_broadcast(overlapping, 0))
    return {"scattered": scattered, "gathered": gathered, "refused": refused}


def test_outputs_that_alias_inputs_get_the_right_parts():
    out = microddp.launch.spawn(_aliased, 2, timeout=60)
    assert out[0]["scattered"] == [0.0] * 4  # the root's own part, written after the sends
    assert out[1]["scattered"] == [7.0] * 4  # what the root's `out` held when it was sent
    assert out[0]["gathered"] == [[0.0] * 4, [1.0] * 4]
    assert "share memory (an expand()ed or as_strided view, strides (1, 1))" in out[0]["refused"]


def test_a_numpy_integer_root_is_the_same_root():
    np = pytest.importorskip("numpy")
    assert _code(np.int64(1)) == _code(1) == 1
