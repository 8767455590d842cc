"""Bucket planning matches PyTorch's reducer exactly; bucket views alias one flat buffer."""

import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from microddp.dp.buckets import Bucket, dense, plan_buckets

DTYPES = [torch.float32, torch.float64, torch.float16]


@st.composite
def tensors_and_limits(draw):
    n = draw(st.integers(1, 12))
    tensors = [torch.empty(draw(st.integers(1, 300)), dtype=draw(st.sampled_from(DTYPES)))
               for _ in range(n)]
    limits = draw(st.lists(st.integers(1, 2000), min_size=1, max_size=3))
    order = draw(st.permutations(range(n)))
    return tensors, limits, list(order)


@settings(max_examples=60, deadline=None)
@given(tensors_and_limits())
def test_plan_equals_torch_assignment_in_parameter_order(case):
    tensors, limits, _ = case
    expected, _ = dist._compute_bucket_assignment_by_size(tensors, limits, [False] * len(tensors))
    assert plan_buckets(tensors, limits) == [list(b) for b in expected]


@settings(max_examples=60, deadline=None)
@given(tensors_and_limits())
def test_plan_equals_torch_rebuild_in_arrival_order(case):
    tensors, limits, order = case
    if len({t.dtype for t in tensors}) > 1:  # torch leaves several open buckets in hash order
        tensors = [t.float() for t in tensors]
    expected, _ = dist._compute_bucket_assignment_by_size(
        [tensors[i] for i in order], limits, [False] * len(tensors), order)
    assert plan_buckets(tensors, limits, order=order) == [list(b) for b in expected]


def test_bucket_views_alias_the_flat_buffer_with_each_parameters_layout():
    a = torch.nn.Parameter(torch.randn(3, 4))
    b = torch.nn.Parameter(torch.randn(4, 3).t())  # transposed: strides (1, 3)
    c = torch.nn.Parameter(torch.randn(5))
    bucket = Bucket([a, b, c])
    assert bucket.flat.numel() == 12 + 12 + 5 and bucket.offsets == [0, 12, 24]
    assert [v.stride() for v in bucket.views] == [a.stride(), b.stride(), c.stride()]
    for p in (a, b, c):
        p.grad = torch.randn_like(p)
    assert [bucket.add(p) for p in (c, a, b)] == [False, False, True]
    for p, v in zip((a, b, c), bucket.views, strict=True):
        assert torch.equal(v, p.grad)
        assert v.untyped_storage().data_ptr() == bucket.flat.untyped_storage().data_ptr()
    bucket.flat.mul_(2)
    bucket.copy_out()
    assert torch.equal(c.grad, bucket.flat[24:])
    assert bucket.pending == 3  # ready for the next backward


def test_dense_recognises_permuted_layouts_only():
    assert dense(torch.empty(3, 4)) and dense(torch.empty(4, 3).t())
    assert not dense(torch.empty(4, 6)[:, ::2]) and not dense(torch.empty(3, 4)[:, :2])
