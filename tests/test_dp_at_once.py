"""Buckets with no backward left to hide behind are all-reduced at once, on the hook's thread
(dp/reducer.py's HIDE_SHARE), the others asynchronously; either way the parameters stay equal
to PyTorch DDP's, bit for bit."""

import torch

import microddp as mdp
from microddp.dp.reducer import HIDE_SHARE, at_once

MiB = 1 << 20


def test_the_last_bucket_and_one_followed_by_little_go_at_once():
    # a bucket followed only by a tiny one has nothing to hide behind either
    assert at_once([MiB, 512]) == [True, True]
    # FullMLP(1024)'s rebuilt plan: every bucket but the last has MiBs of backward after it
    assert at_once([4 * MiB, 28 * MiB, 28 * MiB, 4 * MiB]) == [False, False, False, True]
    # the rule at its edge: exactly HIDE_SHARE of a bucket after it is enough to hide it
    assert at_once([16 * 1024, int(HIDE_SHARE * 16 * 1024)]) == [False, True]
    assert at_once([16 * 1024, int(HIDE_SHARE * 16 * 1024) - 1]) == [True, True]
    assert at_once([MiB]) == [True]
    assert at_once([]) == []


def _steps(world):
    from microddp.dp import wrap
    from microddp.shm import collectives as shm

    params, kinds = [], None
    for engine in ("microddp", "torch"):
        torch.manual_seed(0)
        # 4 KiB buckets: one per layer, so a backward has asynchronous buckets and at-once ones
        model = wrap(mdp.FullMLP(32, 6), engine, bucket_cap_mb=4096 / MiB)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(world.rank)
        for _ in range(4):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(
                model(torch.randn(8, 32, generator=g)),
                torch.randint(0, 2, (8,), generator=g)).backward()
            opt.step()
        if engine == "microddp":
            r = model.reducer
            # a Summing run at once keeps no work: it finished before start_reduction returned
            kinds = [(now, fut.work is None) for now, fut in zip(r.now, r.futures, strict=True)]
        params.append([p.detach().clone() for p in model.parameters()])
    return all(map(torch.equal, *params)), kinds, shm.shared(None) is not None


def test_at_once_and_async_buckets_match_torch_ddp_bit_for_bit():
    for equal, kinds, shared in mdp.spawn(_steps, 2, timeout=120):
        assert shared, "the ranks did not take shared memory"
        assert equal
        assert len(kinds) > 2, kinds
        assert {now for now, _ in kinds} == {True, False}, kinds  # both kinds in one backward
        assert all(now == finished for now, finished in kinds), kinds
