"""ZeRO's bucket collectives on one host go through shared memory (one reduce-scatter, one
all-gather per bucket), and through gloo's per-rank reduces and broadcasts where shared memory
is not used: both give every rank the sums and parameters a single process computes, with
parts of unequal length (padded on shared memory), and each counts what it moves."""

import pytest
import torch

import microddp as mdp
from microddp import monitor, zero
from microddp.shm.lane import ShmWork
from microddp.zero import comm
from microddp.zero.flat import pack, part


def bucket_round(world, numels):
    """Each rank packs its gradients (rank-dependent values) into its own part and the rest,
    reduces them to the owners, then fills the flat parameters from every rank's part.
    Returns (path used, own sums, gathered flat, bytes sent per collective) on this rank."""
    rank, n = mdp.comms.group_rank(), mdp.comms.group_size()
    plan = zero.build(numels, [0] * len(numels), [list(range(len(numels)))], n)
    (b,) = plan.buckets
    grads = [torch.arange(k, dtype=torch.float32) * 0.1 + rank + 1 for k in numels]
    own, rest = torch.empty(b.sizes[rank]), torch.empty(b.numel - b.sizes[rank])
    pack(b, rank, grads, own, rest)
    sent = comm.Sent()
    handles = comm.reduce_to_owners(b, own, rest, rank, sent)
    for h in handles:
        h.wait()
    reduced = sent.total
    flat = torch.full((b.numel,), -1.0)
    flat.narrow(0, b.start(rank), b.sizes[rank]).copy_(own)  # this rank's elements in place
    handles += comm.broadcast_shards(b, flat, rank, sent)
    for h in handles[-1:] if comm.shared_memory(flat) else handles:
        h.wait()
    path = sorted(type(h).__name__ for h in handles)
    return (comm.shared_memory(flat), path, own, flat, reduced, sent.total - reduced,
            b.sizes, b.start(rank))


def expected(world, numels):
    """The bucket's sum over ranks, added in rank order (shared memory's order) in one process."""
    whole = [torch.cat([torch.arange(k, dtype=torch.float32) * 0.1 + r + 1 for k in numels])
             for r in range(world)]
    total = whole[0].clone()
    for w in whole[1:]:
        total += w
    return total


@pytest.mark.parametrize("world,transport", [(2, None), (3, None), (3, "gloo")])
def test_both_paths_give_the_sums_and_parameters_and_count_what_they_move(world, transport,
                                                                           monkeypatch):
    if transport:
        monkeypatch.setenv("MICRODDP_TRANSPORT", transport)
    else:
        monkeypatch.delenv("MICRODDP_TRANSPORT", raising=False)
    numels = [7, 2, 4]  # 13 elements: neither world size divides it, so parts differ
    ranks = mdp.spawn(bucket_round, world, args=(numels,), backend="gloo", timeout=120)
    total = expected(world, numels)
    on_shm = transport != "gloo"
    for rank, (shm, path, own, flat, reduced, gathered, sizes, start) in enumerate(ranks):
        assert shm is on_shm
        assert max(sizes) != min(sizes)
        mine = total[start:start + sizes[rank]]
        if on_shm:
            # one call each way; a padded one finishes through _Then (copying out)
            assert len(path) == 2 and set(path) <= {"ShmWork", "_Then"}
            assert torch.equal(own, mine)  # rank order, as computed above: the same bits
            cap = max(sizes)
            assert reduced == gathered == (world - 1) * cap * 4  # padded parts, as moved
        else:
            assert path == ["Handle"] * 2 * world  # comms' handles: a reduce and a broadcast per rank
            torch.testing.assert_close(own, mine)  # gloo's own order of addition
            assert reduced == (sum(sizes) - sizes[rank]) * 4
            assert gathered == (world - 1) * sizes[rank] * 4
        # every rank ends with every owner's reduced part, exactly as the owner holds it
        for r, (_, _, owner_own, *_rest) in enumerate(ranks):
            s = sum(sizes[:r])
            assert torch.equal(flat[s:s + sizes[r]], owner_own)


def even_round(world):
    """A bucket every rank's part of which has the same length: no padding, no copies."""
    rank, n = mdp.comms.group_rank(), mdp.comms.group_size()
    plan = zero.build([6 * n], [0], [[0]], n)
    (b,) = plan.buckets
    own, rest = torch.full((b.sizes[rank],), float(rank)), torch.ones(b.numel - b.sizes[rank])
    handles = comm.reduce_to_owners(b, own, rest, rank, comm.Sent())
    kinds = {type(h) for h in handles}
    for h in handles:
        h.wait()
    # a dtype shared memory does not carry goes through gloo's per-rank calls
    others = comm.shared_memory(torch.zeros(2, dtype=torch.complex64))
    return kinds, own, [part(b, r, rank, own, rest).numel() for r in range(n)], others


def test_equal_parts_go_straight_from_and_into_the_buffers_and_other_dtypes_go_to_gloo(monkeypatch):
    monkeypatch.delenv("MICRODDP_TRANSPORT", raising=False)
    ranks = mdp.spawn(even_round, 2, backend="gloo", timeout=120)
    for rank, (kinds, own, sizes, others) in enumerate(ranks):
        assert sizes == [6, 6] and others is False
        assert kinds == {ShmWork}  # the reduce wrote `own` itself: nothing copied back
        assert torch.equal(own, torch.full((6,), float(rank) + 1))  # its own part + the other's 1s


def monitored(world):
    """The hang monitor's log of one bucket's reduce-scatter and all-gather."""
    mon = monitor.enable(timeout=30, debug=True)
    try:
        rank, n = mdp.comms.group_rank(), mdp.comms.group_size()
        (b,) = zero.build([5 * n], [0], [[0]], n).buckets
        own, rest = torch.ones(b.sizes[rank]), torch.ones(b.numel - b.sizes[rank])
        flat = torch.zeros(b.numel)
        for h in (comm.reduce_to_owners(b, own, rest, rank, comm.Sent())
                  + comm.broadcast_shards(b, flat, rank, comm.Sent())):
            h.wait()
        return [(e.op, e.done is not None) for e in mon.log.recent]
    finally:
        monitor.disable()


def test_the_hang_monitor_logs_the_shared_memory_calls(monkeypatch):
    monkeypatch.delenv("MICRODDP_TRANSPORT", raising=False)
    for entries in mdp.spawn(monitored, 2, backend="gloo", timeout=120):
        assert ("shm_reduce_scatter", True) in entries and ("shm_all_gather", True) in entries
