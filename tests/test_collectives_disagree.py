"""Issue 56's table: ranks that pass the default collectives different arguments get one
MicroDDPError on every rank, naming the rank and what differs; never a wrong number, a crash
or a hang, and the group still gives the right sum afterwards.

One spawn per world size runs every row (starting ranks costs far more than a row): on 2 ranks
rank 1 differs, on 3 ranks rank 2 does. The property test draws random (shape, dtype, op,
collective) per rank and compares with gloo's own collective where the ranks agree.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import microddp as mdp
from errors_helpers import message
from microddp import collectives as C
from shm_leftovers import left_behind


def _overlapping() -> torch.Tensor:
    return torch.zeros(5).as_strided((3, 3), (1, 1))  # rows overlap in memory


def _twice(odd: bool) -> str:
    x = torch.ones(4)
    mdp.comms.all_reduce(x)  # alike on every rank: it must simply work
    first = f"first {x.tolist()}"
    second = message(lambda: mdp.comms.all_reduce(torch.ones(5 if odd else 4)))
    third = message(lambda: mdp.comms.all_reduce(torch.ones(4), "max" if odd else "sum"))
    return f"{first} | {second} | {third}"


def _p(world, odd: bool, n: int) -> list[torch.Tensor]:
    return [torch.zeros(n) for _ in range(world.world_size)]


# row -> call(world, odd): `odd` on the one rank that passes the other argument
ROWS = {
    "all_reduce shape": lambda w, o: mdp.comms.all_reduce(torch.ones(8 if o else 4)),
    "all_reduce float64": lambda w, o: mdp.comms.all_reduce(
        torch.ones(4, dtype=torch.float64 if o else torch.float32)),
    "all_reduce int32": lambda w, o: mdp.comms.all_reduce(
        torch.ones(4, dtype=torch.float32 if o else torch.int32)),
    "all_reduce op": lambda w, o: mdp.comms.all_reduce(torch.ones(4), "max" if o else "sum"),
    "all_reduce empty": lambda w, o: mdp.comms.all_reduce(torch.ones(4 if o else 0)),
    "all_reduce twice": lambda w, o: _twice(o),
    "all_reduce overlapping everywhere": lambda w, o: mdp.comms.all_reduce(_overlapping()),
    "all_reduce overlapping": lambda w, o: mdp.comms.all_reduce(
        _overlapping() if o else torch.zeros(3, 3)),
    "all_reduce expanded": lambda w, o: mdp.comms.all_reduce(
        torch.ones(1).expand(4) if o else torch.ones(4)),
    "all_reduce list": lambda w, o: mdp.comms.all_reduce([1.0, 2.0] if o else torch.ones(2)),
    "all_reduce sparse": lambda w, o: mdp.comms.all_reduce(
        torch.ones(2).to_sparse() if o else torch.ones(2)),
    "all_reduce against a ring": lambda w, o: (
        C.ring_all_reduce(torch.ones(4)) if o else mdp.comms.all_reduce(torch.ones(4))),
    "broadcast shape": lambda w, o: mdp.comms.broadcast(torch.ones(8 if o else 4)),
    "broadcast dtype": lambda w, o: mdp.comms.broadcast(
        torch.ones(4, dtype=torch.int32 if o else torch.float32)),
    "broadcast src": lambda w, o: mdp.comms.broadcast(torch.ones(4), src=1 if o else 0),
    "shm_broadcast shape": lambda w, o: C.shm_broadcast(torch.ones(8 if o else 4)),
    "shm_broadcast dtype": lambda w, o: C.shm_broadcast(
        torch.ones(4, dtype=torch.int32 if o else torch.float32)),
    "shm_broadcast src": lambda w, o: C.shm_broadcast(torch.ones(4), src=1 if o else 0),
    "shm_reduce_scatter shape": lambda w, o: C.shm_reduce_scatter(
        torch.zeros(5 if o else 4), _p(w, o, 5 if o else 4)),
    "shm_reduce_scatter dtype": lambda w, o: C.shm_reduce_scatter(
        torch.zeros(4, dtype=torch.float64 if o else torch.float32),
        [torch.zeros(4, dtype=torch.float64 if o else torch.float32)] * w.world_size),
    "shm_reduce_scatter op": lambda w, o: C.shm_reduce_scatter(
        torch.zeros(4), _p(w, o, 4), "max" if o else "sum"),
    "shm_all_gather shape": lambda w, o: C.shm_all_gather(
        _p(w, o, 5 if o else 4), torch.ones(5 if o else 4)),
    "shm_all_gather dtype": lambda w, o: C.shm_all_gather(
        [torch.zeros(4, dtype=torch.int32 if o else torch.float32) for _ in range(w.world_size)],
        torch.ones(4, dtype=torch.int32 if o else torch.float32)),
    "all_gather shape": lambda w, o: mdp.comms.all_gather(
        _p(w, o, 5 if o else 4), torch.ones(5 if o else 4)),
    "gather shape": lambda w, o: mdp.comms.gather(
        torch.ones(5 if o else 4), _p(w, o, 4) if w.rank == 0 else None),
    "scatter shape": lambda w, o: mdp.comms.scatter(
        torch.zeros(5 if o else 4), _p(w, o, 4) if w.rank == 0 else None),
    "reduce_scatter shape": lambda w, o: mdp.comms.reduce_scatter(
        torch.zeros(5 if o else 4), _p(w, o, 5 if o else 4)),
    "reduce op": lambda w, o: mdp.comms.reduce(torch.ones(4), op="max" if o else "sum"),
    "barrier against an all_reduce": lambda w, o: (
        mdp.comms.barrier() if o else mdp.comms.all_reduce(torch.ones(4))),
    "gather list on the root": lambda w, o: mdp.comms.gather(  # the differing rank is the root
        torch.ones(4), _p(w, o, 4)[:1] if o else None, dst=w.world_size - 1),
}

# row -> what every rank's error says, and what the differing rank's says instead (None: the same)
EXPECTED = {
    "all_reduce shape": ("ranks disagree on shape", None),
    "all_reduce float64": ("ranks disagree on dtype", None),
    "all_reduce int32": ("ranks disagree on dtype", None),
    "all_reduce op": ("ranks disagree on op", None),
    "all_reduce empty": ("ranks disagree on shape", None),
    "all_reduce twice": ("first [{p}.0, {p}.0, {p}.0, {p}.0] | all_reduce: ranks disagree on "
                         "shape", "ranks disagree on op"),
    "all_reduce overlapping everywhere": ("share memory", None),
    "all_reduce overlapping": ("rejected its arguments", "share memory"),
    "all_reduce expanded": ("rejected its arguments", "share memory"),
    "all_reduce list": ("rejected its arguments", "must be a torch.Tensor, got list"),
    "all_reduce sparse": ("rejected its arguments", "sparse_coo"),
    "all_reduce against a ring": ("called different collectives", None),
    "broadcast shape": ("ranks disagree on shape", None),
    "broadcast dtype": ("ranks disagree on dtype", None),
    "broadcast src": ("ranks disagree on src", None),
    "shm_broadcast shape": ("ranks disagree on shape", None),
    "shm_broadcast dtype": ("ranks disagree on dtype", None),
    "shm_broadcast src": ("ranks disagree on src", None),
    "shm_reduce_scatter shape": ("ranks disagree on shape", None),
    "shm_reduce_scatter dtype": ("ranks disagree on dtype", None),
    "shm_reduce_scatter op": ("ranks disagree on op", None),
    "shm_all_gather shape": ("ranks disagree on shape", None),
    "shm_all_gather dtype": ("ranks disagree on dtype", None),
    "all_gather shape": ("ranks disagree on shape", None),
    "gather shape": ("ranks disagree on shape", None),
    "scatter shape": ("ranks disagree on shape", None),
    "reduce_scatter shape": ("ranks disagree on shape", None),
    "reduce op": ("ranks disagree on op", None),
    "barrier against an all_reduce": ("called different collectives", None),
    "gather list on the root": ("rejected its arguments", "must hold one tensor per rank"),
}


def _table(world, odd_rank: int) -> dict[str, tuple[str, list]]:
    """Every row, then a sum alike on every rank: the group must still be in step."""
    out = {}
    for row, call in ROWS.items():
        odd = world.rank == odd_rank
        said = (call(world, odd) if row == "all_reduce twice"
                else message(lambda call=call, odd=odd: call(world, odd)))
        y = torch.full((5,), float(world.rank + 1))
        mdp.comms.all_reduce(y)
        out[row] = (said, y.tolist())
    return out


_runs: dict[int, list] = {}


def _run(world_size: int) -> list[dict]:
    """The table on `world_size` ranks, run once per test session; /dev/shm checked after."""
    if world_size not in _runs:
        before = left_behind()
        _runs[world_size] = mdp.launch.spawn(_table, world_size, (world_size - 1,), timeout=150)
        assert multiprocessing.active_children() == []
        assert left_behind() - before == set(), "a microddp segment was left in /dev/shm"
    return _runs[world_size]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("row", list(ROWS))
def test_a_row_of_the_table_raises_on_every_rank(row, world_size):
    out = _run(world_size)
    total = world_size * (world_size + 1) // 2
    everyone, odd_one = EXPECTED[row]
    for rank, results in enumerate(out):
        said, after = results[row]
        odd = rank == world_size - 1
        want = (odd_one if odd and odd_one is not None else everyone).format(p=world_size)
        assert want in said, (rank, said)
        if row == "all_reduce twice" and not odd:
            assert "ranks disagree on op" in said.split(" | ")[2], said
        if "disagree" in want or "different collectives" in want:
            assert f"group rank {rank}" in said, said  # names the rank
        assert after == [float(total)] * 5, (rank, row, after)  # still in step, right sum


# -- ranks that share no memory: all_reduce agrees through gloo messages -------------------------

GLOO_ROWS = ("all_reduce shape", "all_reduce float64", "all_reduce int32", "all_reduce op",
             "all_reduce empty", "all_reduce twice")


def _gloo_table(world) -> dict[str, tuple[str, list]]:
    """The all_reduce rows with shared memory off; then DDP's buckets, which skip the round
    (checked=False), still average right."""
    out = {}
    for row in GLOO_ROWS:
        odd = world.rank == world.world_size - 1
        said = (_twice(odd) if row == "all_reduce twice"
                else message(lambda row=row, odd=odd: ROWS[row](world, odd)))
        y = torch.full((5,), float(world.rank + 1))
        mdp.comms.all_reduce(y)
        out[row] = (said, y.tolist())
    torch.manual_seed(0)
    model = mdp.DDP(torch.nn.Linear(3, 2))
    model(torch.full((2, 3), float(world.rank))).sum().backward()
    out["ddp"] = ("", model.module.weight.grad.flatten().tolist())
    return out


def test_all_reduce_between_ranks_that_share_no_memory_agrees_first(monkeypatch):
    """Issue 56: off shared memory (other hosts, or MICRODDP_TRANSPORT=gloo) all_reduce kept
    local checks only: a float32 sum against int32 read the bits as the wrong numbers, another
    shape or op went to gloo as it was. Now every rank raises the same line."""
    monkeypatch.setenv("MICRODDP_TRANSPORT", "gloo")
    out = mdp.launch.spawn(_gloo_table, 2, timeout=150)
    for rank, results in enumerate(out):
        for row in GLOO_ROWS:
            said, after = results[row]
            want = EXPECTED[row][0].format(p=2)
            if row == "all_reduce twice":
                assert "ranks disagree on shape" in said.split(" | ")[1], said
                assert "ranks disagree on op" in said.split(" | ")[2], said
            else:
                assert want in said and f"group rank {rank}" in said, (rank, row, said)
            assert after == [3.0] * 5, (rank, row, after)
        # the mean of the ranks' gradients: inputs 0 and 1, so the mean input 0.5 per column
        assert out[rank]["ddp"][1] == pytest.approx([1.0] * 6), out[rank]["ddp"]


# -- the microddp torch.distributed backend ------------------------------------------------------

BACKEND_ROWS = {
    "all_reduce shape": (lambda o: dist.all_reduce(torch.ones(8 if o else 4)), "shape"),
    "all_reduce dtype": (lambda o: dist.all_reduce(
        torch.ones(4, dtype=torch.int32 if o else torch.float32)), "dtype"),
    "all_reduce op": (lambda o: dist.all_reduce(
        torch.ones(4), op=dist.ReduceOp.MAX if o else dist.ReduceOp.SUM), "op"),
    "all_reduce contiguity": (lambda o: dist.all_reduce(
        torch.ones(4, 2).t() if o else torch.ones(2, 4)), "shared_memory"),
    "broadcast shape": (lambda o: dist.broadcast(torch.ones(8 if o else 4), 0), "shape"),
    "broadcast src": (lambda o: dist.broadcast(torch.ones(4), 1 if o else 0), "src"),
    "all_gather shape": (lambda o: dist.all_gather([torch.zeros(5 if o else 4) for _ in "ab"],
                                                   torch.ones(5 if o else 4)), "shape"),
    "all_gather bool": (lambda o: dist.all_gather(
        [torch.zeros(4, dtype=torch.bool if o else torch.uint8) for _ in range(2)],
        torch.ones(4, dtype=torch.bool if o else torch.uint8)), "dtype"),
}


def _backend_table(rank: int) -> dict[str, tuple[str, list]]:
    import microddp.backend  # noqa: F401 (registers the backend, as a user's script does)

    dist.init_process_group("microddp")
    out = {}
    try:
        for row, (call, _) in BACKEND_ROWS.items():
            said = message(lambda call=call: call(rank == 1))
            y = torch.full((5,), float(rank + 1))
            dist.all_reduce(y)
            out[row] = (said, y.tolist())
    finally:
        dist.destroy_process_group()
    return out


def test_the_backend_raises_on_every_rank():
    before = left_behind()
    out = mdp.launch.spawn(_backend_table, 2, timeout=120, join=False)
    assert left_behind() - before == set()
    for rank, results in enumerate(out):
        for row, (_, what) in BACKEND_ROWS.items():
            said, after = results[row]
            assert f"ranks disagree on {what}" in said and f"group rank {rank}" in said, (
                rank, row, said)
            assert after == [3.0] * 5, (rank, row, after)


# -- random pairs of calls: the reference result on both ranks, or an error on both -----------

CALLS = ["all_reduce", "broadcast", "all_gather", "reduce_scatter", "gather", "scatter",
         "shm_all_reduce", "shm_broadcast"]
DTYPES = {"float32": torch.float32, "float64": torch.float64, "int32": torch.int32,
          "bfloat16": torch.bfloat16}
OPS = ["sum", "avg", "max", "product"]
CALL = st.fixed_dictionaries({
    "shape": st.sampled_from([(4,), (8,), (0,), (2, 3), (3, 2), (1,)]),
    "dtype": st.sampled_from(sorted(DTYPES)),
    "op": st.sampled_from(OPS),
    "call": st.sampled_from(CALLS),
})
# a pair of calls, alike in about half the draws: both sides of the property get exercised
PAIR = st.one_of(CALL.map(lambda c: (c, c)), st.tuples(CALL, CALL))


def _input(case: dict, rank: int) -> torch.Tensor:
    n = 1
    for d in case["shape"]:
        n *= d
    return (torch.arange(n, dtype=torch.float64) % 5 + rank + 1).reshape(case["shape"]).to(
        DTYPES[case["dtype"]])


def _call(case: dict, rank: int, p: int, group, ours: bool) -> list[torch.Tensor]:
    """One case through microddp (`ours`) or through torch on the gloo `group`; what it wrote."""
    x, name, op = _input(case, rank), case["call"], case["op"]
    like = [torch.zeros_like(x) for _ in range(p)]
    if not ours:
        torch_op = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM,
                    "max": dist.ReduceOp.MAX, "product": dist.ReduceOp.PRODUCT}[op]
        name = name.removeprefix("shm_")
    if name == "all_reduce":
        if ours:
            mdp.comms.all_reduce(x, op)
        else:
            dist.all_reduce(x, torch_op, group)
            if op == "avg":
                x.div_(p)
        return [x]
    if name == "shm_all_reduce":
        C.shm_all_reduce(x, op)
        return [x]
    if name in ("broadcast", "shm_broadcast"):
        (mdp.comms.broadcast if name == "broadcast" else C.shm_broadcast)(x, 0) if ours else \
            dist.broadcast(x, 0, group)
        return [x]
    if name == "all_gather":
        mdp.comms.all_gather(like, x) if ours else dist.all_gather(like, x, group)
        return like
    if name == "reduce_scatter":
        out = torch.zeros_like(x)
        parts = [x * (i + 1) for i in range(p)]
        if ours:
            mdp.comms.reduce_scatter(out, parts, op)
        else:
            dist.reduce_scatter(out, parts, torch_op, group)
            if op == "avg":
                out.div_(p)
        return [out]
    if name == "gather":
        got = like if rank == 0 else None
        mdp.comms.gather(x, got, 0) if ours else dist.gather(x, got, 0, group)
        return like
    parts = [x * (i + 1) for i in range(p)] if rank == 0 else None
    out = torch.zeros_like(x)
    mdp.comms.scatter(out, parts, 0) if ours else dist.scatter(out, parts, 0, group)
    return [out]


def _used(case: dict) -> dict:
    """What a call takes of a case: the op only where it reduces."""
    return case if "reduce" in case["call"] else {**case, "op": None}


def _pairs(world, pairs: list) -> list:
    gloo = dist.new_group(backend="gloo")  # the reference: torch's own collectives
    out = []
    for pair in pairs:
        mine = pair[world.rank]
        try:
            got = _call(mine, world.rank, world.world_size, None, True)
        except mdp.MicroDDPError as e:
            out.append(("error", str(e)))
            continue
        alike = _used(pair[0]) == _used(pair[1])
        ref = _call(mine, world.rank, world.world_size, gloo, False) if alike else None
        out.append(("ok", [t.tolist() for t in got], ref and [t.tolist() for t in ref]))
    return out


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pairs=st.lists(PAIR, min_size=40, max_size=40))
def test_random_pairs_give_the_reference_or_an_error_on_both_ranks(pairs):
    out = mdp.launch.spawn(_pairs, 2, (pairs,), timeout=150)
    for i, pair in enumerate(pairs):
        a, b = out[0][i], out[1][i]
        assert a[0] == b[0], (pair, a, b)  # both return, or both raise
        if a[0] == "error":
            continue
        assert _used(pair[0]) == _used(pair[1]), (pair, a, b)  # ranks that differ never both return
        assert a[1] == a[2] and b[1] == b[2], (pair, a, b)  # gloo's result, exactly
