"""Data: bundled digits, sharding (disjoint, complete, reshuffled, uneven), exact evaluation."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import microddp
from microddp.data import (
    ShardedBatchSampler,
    digits,
    evaluate,
    load_dataset,
    shard_range,
    synthetic,
)
from microddp.errors import MicroDDPError
from microddp.model import FullMLP


def test_digits_is_sklearns_data_split_once_and_for_all():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    ds = digits()
    assert (len(ds.train), len(ds.test)) == (1438, 359)
    allx = torch.cat([ds.train.x, ds.test.x])
    ally = torch.cat([ds.train.y, ds.test.y])
    # Every image appears exactly once across the two splits, with its own label.
    got = sorted(zip(((allx + 1) * 8).round().to(torch.int64).tolist(), ally.tolist(), strict=True))
    want = sorted(zip(x.astype(np.int64).tolist(), y.tolist(), strict=True))
    assert got == want
    again = digits()
    assert torch.equal(again.test.x, ds.test.x) and torch.equal(again.train.y, ds.train.y)


def test_synthetic_is_deterministic_and_unknown_names_are_refused():
    a, b = synthetic(), synthetic()
    assert torch.equal(a.train.x, b.train.x) and torch.equal(a.test.y, b.test.y)
    assert (len(a.train), len(a.test), a.n_classes) == (2048, 512, 10)
    with pytest.raises(MicroDDPError, match="unknown dataset 'mnist'.*digits, synthetic"):
        load_dataset("mnist")


def _epoch(samplers):
    """One epoch from every rank's sampler: list over steps of list over ranks."""
    return [list(step) for step in zip(*[list(s) for s in samplers], strict=True)]


@pytest.mark.parametrize("n,batch,world", [(37, 8, 4), (40, 8, 2), (10, 3, 3), (5, 4, 4)])
def test_shards_are_disjoint_complete_and_uneven_only_at_the_end(n, batch, world):
    samplers = [ShardedBatchSampler(n, batch, r, world, seed=3, allow_empty=True)
                for r in range(world)]
    steps = _epoch(samplers)
    assert len(steps) == len(samplers[0]) == -(-n // batch)
    seen = [i for step in steps for shard in step for i in shard]
    assert sorted(seen) == list(range(n))  # each sample once: nothing dropped, nothing padded
    for s, step in enumerate(steps):
        sizes = [len(shard) for shard in step]
        assert sum(sizes) == min(batch, n - s * batch)
        assert max(sizes) - min(sizes) <= 1
    # The ranks' shards of a step, in rank order, are exactly that step's global batch.
    glob = samplers[0].global_batches(0)
    assert [sum(step, []) for step in steps] == [b.tolist() for b in glob]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 120), per_rank=st.integers(1, 9), world=st.integers(1, 5),
       seed=st.integers(0, 3))
def test_any_shape_of_sharding_covers_each_sample_once(n, per_rank, world, seed):
    samplers = [ShardedBatchSampler(n, per_rank * world, r, world, seed=seed, allow_empty=True)
                for r in range(world)]
    for _ in range(2):  # two epochs, two different orders, each complete
        steps = _epoch(samplers)
        assert sorted(i for step in steps for shard in step for i in shard) == list(range(n))
        assert all(max(map(len, s)) - min(map(len, s)) <= 1 for s in steps)
    # Without allow_empty, exactly the shapes that leave some rank an empty batch are refused.
    empty = any(len(shard) == 0 for step in steps for shard in step)
    try:
        ShardedBatchSampler(n, per_rank * world, 0, world, seed=seed)
        refused = False
    except MicroDDPError:
        refused = True
    assert refused == empty


def test_an_empty_batch_is_a_clear_error_not_a_dataloader_crash():
    data = TensorDataset(torch.arange(7.0))
    # 7 = 2 x 3 + 1: the last global batch cannot give each of 3 ranks a sample.
    with pytest.raises(MicroDDPError, match=r"last global batch holds 1 sample\(s\) \(7 samples"
                                            r" in batches of 3\), fewer than the 3 ranks.*"
                                            r"drop_last=True.*allow_empty=True"):
        ShardedBatchSampler(7, 3, rank=2, world_size=3)
    with pytest.raises(MicroDDPError, match="global batch of 2 sample.*at least 3"):
        ShardedBatchSampler(70, 2, rank=0, world_size=3)
    with pytest.raises(MicroDDPError, match="2 sample.*for 3 ranks"):
        ShardedBatchSampler(2, 6, rank=0, world_size=3)
    # Each remedy the message names works under a DataLoader, on every rank.
    for rank in range(3):
        kept = ShardedBatchSampler(7, 3, rank, 3, shuffle=False, drop_last=True)
        assert [b.tolist() for (b,) in DataLoader(data, batch_sampler=kept)] == [[rank], [3 + rank]]
        wider = ShardedBatchSampler(7, 4, rank, 3, shuffle=False)  # 7 = 4 + 3: enough for all
        assert [len(b) for (b,) in DataLoader(data, batch_sampler=wider)] == [[2, 1, 1][rank], 1]
    # allow_empty: the built-in loop's way, an empty shard on the last step (loss summed).
    loose = ShardedBatchSampler(7, 3, 2, 3, shuffle=False, allow_empty=True)
    assert list(loose) == [[2], [5], []]


def test_reshuffles_every_epoch_without_set_epoch_unlike_torch():
    n, world = 24, 2
    ours = ShardedBatchSampler(n, 8, 0, world, seed=5)
    torchs = DistributedSampler(range(n), num_replicas=world, rank=0, seed=5)
    our_orders = [sum(list(ours), []) for _ in range(3)]
    torch_orders = [list(torchs) for _ in range(3)]
    assert torch_orders[0] == torch_orders[1] == torch_orders[2]  # the forgotten set_epoch
    assert len({tuple(o) for o in our_orders}) == 3
    for epoch, order in enumerate(our_orders):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(5 + epoch))
        assert order == sum((b[:4].tolist() for b in perm.split(8)), [])


def test_drop_last_and_set_epoch():
    s = ShardedBatchSampler(37, 8, 1, 2, seed=0, drop_last=True)
    assert len(s) == 4 and all(len(b) == 4 for b in s)
    s.set_epoch(7)
    assert sum(list(s), []) == sum((b[4:8].tolist() for b in s.global_batches(7)), [])
    with pytest.raises(MicroDDPError, match="leaves no batch"):
        ShardedBatchSampler(3, 8, drop_last=True)


def test_state_dict_resumes_at_the_next_batch():
    full = ShardedBatchSampler(51, 6, 1, 3, seed=9)
    expected = [b for _ in range(2) for b in full]  # two epochs, uninterrupted
    first = ShardedBatchSampler(51, 6, 1, 3, seed=9)
    got = list(first)  # epoch 1, then stop in the middle of epoch 2
    it = iter(first)
    got += [next(it), next(it)]
    state = first.state_dict()
    assert (state["epoch"], state["position"]) == (1, 2)
    second = ShardedBatchSampler(51, 6, 1, 3, seed=0)
    second.load_state_dict(state)
    got += list(second)
    assert got == expected
    with pytest.raises(MicroDDPError, match="batches of 6.*original --batch-size"):
        ShardedBatchSampler(50, 5).load_state_dict(state)


def test_state_dict_counts_consumed_batches_under_a_prefetching_dataloader():
    data = TensorDataset(torch.arange(100))
    expected = [b.tolist() for (b,) in DataLoader(data, batch_sampler=ShardedBatchSampler(
        100, 10, seed=4))]
    s = ShardedBatchSampler(100, 10, seed=4)
    it = iter(DataLoader(data, batch_sampler=s, num_workers=2))
    got = [next(it)[0].tolist()]
    assert s.state_dict()["position"] > 1  # the workers drew ahead of the loop
    state = s.state_dict(consumed=1)
    assert (state["epoch"], state["position"]) == (0, 1)
    del it
    resumed = ShardedBatchSampler(100, 10, seed=0)
    resumed.load_state_dict(state)
    got += [b.tolist() for (b,) in DataLoader(data, batch_sampler=resumed, num_workers=2)]
    assert got == expected
    # `consumed` counts from where the latest iterator began, a resumed one included.
    it = iter(resumed)
    next(it)
    assert (resumed.state_dict(consumed=0)["epoch"], resumed.state_dict(consumed=3)["position"]) \
        == (1, 3)
    with pytest.raises(MicroDDPError, match="consumed=11.*holds 10"):
        resumed.state_dict(consumed=11)


def test_set_epoch_after_load_state_dict_keeps_the_restored_place():
    full = ShardedBatchSampler(51, 6, 1, 3, seed=9)
    expected = list(full)[4:]
    first = ShardedBatchSampler(51, 6, 1, 3, seed=9)
    it = iter(first)
    for _ in range(4):
        next(it)
    again = ShardedBatchSampler(51, 6, 1, 3, seed=9)
    again.load_state_dict(first.state_dict())
    again.set_epoch(0)  # torch's habit: load, then set_epoch at the top of the epoch
    assert list(again) == expected
    again.set_epoch(0)  # once iterated, set_epoch replays the epoch as before
    assert list(again) == list(ShardedBatchSampler(51, 6, 1, 3, seed=9))
    other = ShardedBatchSampler(51, 6, 1, 3, seed=9)
    other.load_state_dict(first.state_dict())
    other.set_epoch(3)  # another epoch than the restored one starts at its first batch
    assert next(iter(other)) == full.global_batches(3)[0][2:4].tolist()


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 200), world=st.integers(1, 9))
def test_shard_range_partitions(n, world):
    parts = [shard_range(n, r, world) for r in range(world)]
    assert [i for p in parts for i in p] == list(range(n))
    assert max(len(p) for p in parts) - min(len(p) for p in parts) <= 1


def _eval_worker(world, n_test):
    ds = digits()
    torch.manual_seed(1)
    model = FullMLP(16, depth=1, n_classes=10, in_features=64)
    split = type(ds.test)(ds.test.x[:n_test], ds.test.y[:n_test])
    return evaluate(model, split, world, batch_size=7)


@pytest.mark.parametrize("world_size", [2, 3])
def test_distributed_evaluation_equals_single_process(world_size):
    n_test = 359  # prime: no world size splits it evenly
    results = microddp.launch.spawn(_eval_worker, world_size, args=(n_test,), timeout=60)
    ds = digits()
    torch.manual_seed(1)
    model = FullMLP(16, depth=1, n_classes=10, in_features=64)
    with torch.no_grad():
        logits = model(ds.test.x[:n_test])
    correct = int((logits.argmax(1) == ds.test.y[:n_test]).sum())
    loss = F.cross_entropy(logits, ds.test.y[:n_test]).item()
    assert 0 < correct < n_test  # a real mix of right and wrong answers
    for r in results:
        assert (r["correct"], r["count"]) == (correct, n_test)
        assert r["accuracy"] == correct / n_test
        assert r["loss"] == pytest.approx(loss, rel=1e-6)
    single = _eval_worker(microddp.init(), n_test)
    assert (single["correct"], single["count"], single["accuracy"]) == (correct, n_test,
                                                                        correct / n_test)
    # The loss too is the single process's exactly, not up to rounding: per-sample losses are
    # added in float64, so cutting the split into other shards and batches changes nothing.
    assert [r["loss"] for r in results] == [single["loss"]] * world_size
