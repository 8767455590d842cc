"""Every comms wrapper against values computed by hand, on 1, 2, 3 and 4 ranks."""

import pytest
import torch

import microddp as mdp
from microddp import comms


def _data(rank: int, dtype=torch.float64) -> torch.Tensor:
    # Distinct, exactly representable values per rank and position.
    return (torch.arange(6, dtype=torch.float64) + 1 + 10 * rank).to(dtype)


def _expected(op: str, n: int, dtype=torch.float64) -> torch.Tensor:
    stacked = torch.stack([_data(r, torch.float64) for r in range(n)])
    if op == "sum":
        out = stacked.sum(0)
    elif op == "avg":
        out = stacked.mean(0)
    elif op == "product":
        out = stacked.prod(0)
    elif op == "min":
        out = stacked.min(0).values
    else:
        out = stacked.max(0).values
    return out.to(dtype)


def _int_bits(rank: int) -> torch.Tensor:
    return torch.tensor([0b1111, 0b1010, 1 << rank, 7 - rank], dtype=torch.int64)


def _all_ops(world):
    """Run every wrapper once; return what each produced so the parent can check it."""
    n, r = world.world_size, world.rank
    out = {}
    for op in ("sum", "avg", "product", "min", "max"):
        t = _data(r)
        comms.all_reduce(t, op)
        out[f"all_reduce_{op}"] = t
        t = _data(r)
        comms.all_reduce(t, op, async_op=True).wait()
        out[f"all_reduce_async_{op}"] = t
    for op in ("band", "bor", "bxor"):
        t = _int_bits(r)
        comms.all_reduce(t, op)
        out[f"all_reduce_{op}"] = t
    t = _data(r, torch.float32)
    comms.all_reduce_mean(t)
    out["mean"] = t
    t = _data(r) if r == n - 1 else torch.zeros(6, dtype=torch.float64)
    comms.broadcast(t, src=n - 1)
    out["broadcast"] = t
    gathered = [torch.zeros(6, dtype=torch.float64) for _ in range(n)]
    comms.all_gather(gathered, _data(r))
    out["all_gather"] = torch.stack(gathered)
    o = torch.zeros(6, dtype=torch.float64)
    comms.reduce_scatter(o, [_data(r) * (i + 1) for i in range(n)], "sum")
    out["reduce_scatter"] = o
    t = _data(r)
    comms.reduce(t, dst=0, op="max")
    out["reduce"] = t
    o = torch.zeros(6, dtype=torch.float64)
    comms.scatter(o, [_data(i) * 2 for i in range(n)] if r == 0 else None, src=0)
    out["scatter"] = o
    glist = [torch.zeros(6, dtype=torch.float64) for _ in range(n)] if r == n - 1 else None
    comms.gather(_data(r), glist, dst=n - 1)
    out["gather"] = torch.stack(glist) if glist is not None else None
    comms.barrier()
    out["world"] = (world.rank, world.world_size, world.local_rank, world.backend)
    if n > 1:  # point to point around a ring: send right, receive from the left
        right, left = (r + 1) % n, (r - 1) % n
        got = torch.zeros(6, dtype=torch.float64)
        handle = comms.isend(_data(r), right)
        src = comms.recv(got, left) if r % 2 else None
        if r % 2 == 0:
            h = comms.irecv(got, left)
            h.wait()
            src = left
        handle.wait()
        out["ring_p2p"] = (src, got)
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_wrapper_matches_hand_computed_values(n):
    results = mdp.spawn(_all_ops, n, timeout=90)
    for r, out in enumerate(results):
        assert out["world"] == (r, n, r, "gloo" if n > 1 else None)
        for op in ("sum", "avg", "product", "min", "max"):
            assert torch.equal(out[f"all_reduce_{op}"], _expected(op, n)), op
            assert torch.equal(out[f"all_reduce_async_{op}"], _expected(op, n)), op
        bits = [_int_bits(i) for i in range(n)]
        band, bor, bxor = bits[0].clone(), bits[0].clone(), bits[0].clone()
        for b in bits[1:]:
            band &= b
            bor |= b
            bxor ^= b
        assert torch.equal(out["all_reduce_band"], band)
        assert torch.equal(out["all_reduce_bor"], bor)
        assert torch.equal(out["all_reduce_bxor"], bxor)
        assert torch.allclose(out["mean"], _expected("avg", n, torch.float32), rtol=1e-6)
        assert torch.equal(out["broadcast"], _data(n - 1))
        assert torch.equal(out["all_gather"], torch.stack([_data(i) for i in range(n)]))
        assert torch.equal(out["reduce_scatter"], sum(_data(i) for i in range(n)) * (r + 1))
        if r == 0:
            assert torch.equal(out["reduce"], _expected("max", n))
        assert torch.equal(out["scatter"], _data(r) * 2)
        if r == n - 1:
            assert torch.equal(out["gather"], torch.stack([_data(i) for i in range(n)]))
        if n > 1:
            src, got = out["ring_p2p"]
            assert src == (r - 1) % n and torch.equal(got, _data((r - 1) % n))


def _subgroups(world):
    """Ranks {0, 2} and {1, 3} reduce separately; every rank creates both groups, as torch asks."""
    evens = comms.new_group([0, 2])
    odds = comms.new_group([1, 3])
    mine = evens if world.rank % 2 == 0 else odds
    t = torch.tensor([float(world.rank + 1)])
    comms.all_reduce(t, "sum", group=mine)
    avg = torch.tensor([float(world.rank)])
    comms.all_reduce(avg, "avg", group=mine)
    return float(t.item()), float(avg.item()), comms.group_size(mine), comms.group_rank(mine)


def test_subgroups_reduce_only_their_members():
    results = mdp.spawn(_subgroups, 4, timeout=90)
    assert results[0][:2] == (1 + 3, 1.0) and results[2][:2] == (4.0, 1.0)
    assert results[1][:2] == (2 + 4, 2.0) and results[3][:2] == (6.0, 2.0)
    assert [r[2] for r in results] == [2, 2, 2, 2]
    assert [r[3] for r in results] == [0, 0, 1, 1]


def test_world_of_one_needs_no_process_group():
    world = mdp.init()
    assert (world.rank, world.world_size, world.backend) == (0, 1, None)
    t = torch.tensor([3.0, 4.0])
    comms.all_reduce(t, "avg")
    assert torch.equal(t, torch.tensor([3.0, 4.0]))
    out = [torch.zeros(2)]
    comms.all_gather(out, t)
    assert torch.equal(out[0], t)
    assert comms.barrier(async_op=True).is_completed()
    with pytest.raises(mdp.MicroDDPError, match="no other rank"):
        comms.send(t, 1)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: comms.all_reduce(torch.ones(2), "median"), "unknown reduce op"),
        (lambda: comms.all_reduce(torch.ones(2), "bxor"), "integer or bool"),
        (lambda: comms.all_reduce(torch.ones(2, dtype=torch.int64), "avg"), "floating-point"),
        (lambda: comms.all_gather([], torch.ones(2)), "one tensor per rank"),
    ],
)
def test_bad_arguments_raise_clear_errors(call, message):
    with pytest.raises(mdp.MicroDDPError, match=message):
        call()


def _poll_handles(world):
    """Chapter 2's claim: on gloo a point-to-point handle is not completed before wait(), even
    once the data is there; an async collective's handle completes by itself."""
    import time

    other = 1 - world.rank
    inbox = torch.zeros(4)
    recv = comms.irecv(inbox, src=other)
    send = comms.isend(torch.full((4,), float(world.rank + 1)), dst=other)
    deadline = time.monotonic() + 1.0
    while inbox[0].item() == 0 and time.monotonic() < deadline:
        pass  # wait until the bytes have landed, without calling wait()
    arrived = inbox.tolist()
    polled = (recv.is_completed(), send.is_completed())
    recv.wait()
    send.wait()
    waited = (recv.is_completed(), send.is_completed())
    t = torch.ones(3)
    handle = comms.all_reduce(t, async_op=True)
    deadline = time.monotonic() + 30
    while not handle.is_completed() and time.monotonic() < deadline:
        time.sleep(0.001)
    collective = handle.is_completed()
    handle.wait()
    return arrived, polled, waited, collective, t.tolist()


def test_is_completed_as_chapter_2_describes():
    for rank, (arrived, polled, waited, collective, t) in enumerate(
            mdp.spawn(_poll_handles, 2, timeout=90)):
        assert arrived == [float(2 - rank)] * 4  # the data is there ...
        assert polled == (False, False)  # ... yet the p2p handles say not done until wait()
        assert waited == (True, True)
        assert collective is True and t == [2.0, 2.0, 2.0]
