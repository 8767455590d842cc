"""The sharding plan is plain data: every element of every parameter is owned by exactly one
rank, shards are balanced to within one element, buckets are DDP's; a bucket packs into the
rank's own part and the others', and the others' buffer goes once sent."""

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from microddp import MicroDDPError, zero
from microddp.zero.comm import free_when_sent
from microddp.zero.flat import flat_views, pack, part, take_own


def owners(plan):
    """Per parameter, per element: the (rank, slot offset) that holds it."""
    where = [[None] * n for n in plan.numels]
    for b in plan.buckets:
        for piece in b.pieces:
            for k in range(piece.length):
                assert where[piece.param][piece.start + k] is None, "an element owned twice"
                where[piece.param][piece.start + k] = (b.index, piece.rank, piece.offset + k)
    return where


@settings(max_examples=60, deadline=None)
@given(numels=st.lists(st.integers(0, 40), min_size=1, max_size=9),
       world_size=st.integers(1, 5), cap=st.integers(1, 60), two_groups=st.booleans())
def test_every_element_owned_once_and_shards_balanced_within_one(numels, world_size, cap,
                                                                 two_groups):
    groups = [i % 2 if two_groups else 0 for i in range(len(numels))]
    plan = zero.build(numels, groups, zero.by_size(numels, groups, cap), world_size)
    where = owners(plan)
    assert all(None not in w for w in where)
    for b in plan.buckets:
        assert max(b.sizes) - min(b.sizes) <= 1 and sum(b.sizes) == b.numel
        assert b.cap == max(b.sizes)
        assert len({groups[i] for i in b.params}) <= 1
    owned = [plan.owned(r) for r in range(world_size)]
    assert max(owned) - min(owned) <= 1 and sum(owned) == sum(numels)


def test_a_parameter_straddling_ranks_is_split_by_elements_not_given_whole():
    # torch's ZeroRedundancyOptimizer would give the 10-element tensor to one rank whole
    plan = zero.build([10, 1, 1], [0, 0, 0], [[0, 1, 2]], 3)
    assert plan.buckets[0].sizes == (4, 4, 4)
    assert [(p.param, p.start, p.rank, p.length) for p in plan.buckets[0].pieces] == [
        (0, 0, 0, 4), (0, 4, 1, 4), (0, 8, 2, 2), (1, 0, 2, 1), (2, 0, 2, 1)]


def test_the_spare_element_rotates_so_the_totals_stay_balanced():
    plan = zero.build([4, 4, 4], [0, 0, 0], [[0], [1], [2]], 3)
    assert [b.sizes for b in plan.buckets] == [(2, 1, 1), (1, 2, 1), (1, 1, 2)]
    assert [plan.owned(r) for r in range(3)] == [4, 4, 4]
    assert "slot 2 -> r0:2 r1:1 r2:1" in plan.describe()


def test_a_bucket_is_its_parameters_end_to_end_and_each_rank_owns_a_part():
    torch.manual_seed(0)
    tensors = [torch.randn(2, 3), torch.randn(0), torch.randn(5)]
    plan = zero.build([6, 0, 5], [0, 0, 0], [[2, 0, 1]], 4)
    (b,) = plan.buckets
    whole = torch.cat([tensors[2], tensors[0].reshape(-1)])
    for rank in range(4):  # gradients, halved on the way in, split into own part and the rest
        own, rest = torch.empty(b.sizes[rank]), torch.empty(b.numel - b.sizes[rank])
        pack(b, rank, tensors, own, rest, 0.5)
        lo, hi = b.start(rank), b.start(rank) + b.sizes[rank]
        assert torch.equal(own, whole[lo:hi] * 0.5)
        assert torch.equal(rest, torch.cat([whole[:lo], whole[hi:]]) * 0.5)
        for r in range(4):  # each rank's part, as the reduce to that rank sends it
            assert torch.equal(part(b, r, rank, own, rest),
                               whole[b.start(r):b.start(r) + b.sizes[r]] * 0.5)
    # the flat buffer the parameters become views of holds rank r's elements from start(r):
    # what rank r is reduced to and broadcasts from
    params = [t.clone() for t in tensors]
    flat = flat_views(b, params)
    assert all(torch.equal(x, y) for x, y in zip(tensors, params, strict=True))
    assert flat.data_ptr() == params[2].data_ptr()  # bucket order: param 2 first
    assert [b.start(r) for r in range(4)] == [0, 3, 6, 9] and b.sizes == (3, 3, 3, 2)
    for r in range(4):
        mine = torch.empty(b.sizes[r])
        take_own(b, r, tensors, mine)
        assert torch.equal(mine, flat[b.start(r):b.start(r) + b.sizes[r]])
    flat.fill_(7)  # writing the buffer writes the parameters
    assert all(bool((t == 7).all()) for t in params)
    own, rest = torch.ones(b.sizes[1]), torch.ones(b.numel - b.sizes[1])
    pack(b, 1, [None, None, None], own, rest)  # a gradient backward never made counts as zero
    assert own.abs().sum() == 0 and rest.abs().sum() == 0


def test_buckets_follow_backward_order_and_split_at_the_cap_and_at_groups():
    assert zero.by_size([4, 4, 4, 4], [0, 0, 0, 0], 8) == [[3, 2], [1, 0]]
    assert zero.by_size([4, 4, 4, 4], [0, 0, 1, 1], 100) == [[3, 2], [1, 0]]
    # a bucket closes once it holds its cap or more, as DDP's do: the tensor that reaches the
    # cap joins the bucket rather than opening the next one
    assert zero.by_size([50, 1], [0, 0], 8) == [[1, 0]]
    assert zero.by_size([50, 1, 1], [0, 0, 0], 2) == [[2, 1], [0]]
    # a small first bucket (DDP's 1 MiB), then the usual cap
    assert zero.by_size([4, 4, 4, 4, 4], [0] * 5, 100, first_cap_elements=4) == [[4], [3, 2, 1, 0]]


@settings(max_examples=60, deadline=None)
@given(numels=st.lists(st.integers(1, 300), min_size=1, max_size=12),
       cap=st.integers(1, 600), first=st.integers(1, 600))
def test_buckets_are_the_ones_torch_ddp_rebuilds_in_backward_order(numels, cap, first):
    # DDP's rebuilt buckets follow the gradients' arrival order (reverse parameter order, as
    # backward makes them ready) with a small first cap: ZeRO's buckets are the same ones
    tensors = [torch.empty(n) for n in numels]
    order = list(reversed(range(len(numels))))
    expected, _ = dist._compute_bucket_assignment_by_size(
        [tensors[i] for i in order], [4 * first, 4 * cap], [False] * len(tensors), order)
    got = zero.by_size(numels, [0] * len(numels), cap, first_cap_elements=first)
    assert got == [list(b) for b in expected]


def test_a_bad_plan_is_one_clear_error():
    with pytest.raises(MicroDDPError, match="exactly one bucket"):
        zero.build([1, 2], [0, 0], [[0]], 2)
    with pytest.raises(MicroDDPError, match="mixes parameter groups"):
        zero.build([1, 2], [0, 1], [[0, 1]], 2)


def test_a_packed_buffer_is_released_when_the_last_collective_sending_it_completes():
    class Sent:  # a stand-in for a collective's handle: its future completes when set
        def __init__(self):
            self.future = torch.futures.Future()

        def get_future(self):
            return self.future

    handles, buffer = [Sent(), Sent()], torch.ones(1000)
    released = free_when_sent(handles, buffer)
    handles[1].future.set_result([buffer])
    assert buffer.untyped_storage().nbytes() == 4000  # one reduce still sending it
    handles[0].future.set_result([buffer])
    released.wait()
    assert buffer.untyped_storage().nbytes() == 0
