"""The alpha-beta-gamma cost model and its fit: exact formulas, exact recovery of known
parameters, and agreement with the bytes the algorithms really send."""

from __future__ import annotations

import math

import pytest
import torch

import microddp
from microddp import MicroDDPError
from microddp import collectives as C
from microddp.bench.allreduce import parse_size, repeats_for
from microddp.collectives import cost
from microddp.collectives.cost import ALGORITHMS, CostModel, bytes_sent, fit_line, fit_lines
from microddp.collectives.ring import (
    PAIR_MIN_CHUNK,
    PAIR_SEGMENT,
    PIPELINE_MIN_CHUNK,
    PIPELINE_SEGMENT,
    ring_segments,
)

M = CostModel(alpha=1e-5, beta=1e-9, gamma=2e-10)


def test_ring_formula():
    n, p = 8 << 20, 4
    expected = 2 * 3 * (1e-5 + (n / 4) * 1e-9) + 3 * (n / 4) * 2e-10
    assert M.ring_all_reduce(n, p) == pytest.approx(expected, rel=1e-12)
    # the two halves add up to the whole
    assert M.ring_reduce_scatter(n, p) + M.ring_all_gather(n, p) == pytest.approx(
        M.ring_all_reduce(n, p), rel=1e-12)


def test_pipelined_ring_formula_and_segments_the_ring_sends():
    """k segments: the same latency and bytes per step, but only one segment's add exposed."""
    n, p, k = 64 << 20, 4, 16
    expected = 2 * 3 * (1e-5 + (n / 4) * 1e-9) + 3 * (n / 4 / k) * 2e-10
    assert M.ring_all_reduce(n, p, segments=k) == pytest.approx(expected, rel=1e-12)
    assert M.predict("ring_all_reduce", n, p, segments=1) == M.ring_all_reduce(n, p)
    # The ring's own choice, on gloo: whole chunks below PIPELINE_MIN_CHUNK, then segments of
    # at most PIPELINE_SEGMENT; on 2 ranks, from PAIR_MIN_CHUNK, the pair loop's segments of at
    # most PAIR_SEGMENT.
    at = PIPELINE_MIN_CHUNK * p
    assert ring_segments(at - 4 * p, p) == 1
    assert ring_segments(at, p) == -(-PIPELINE_MIN_CHUNK // PIPELINE_SEGMENT)
    assert ring_segments(at + 4 * p, p) == ring_segments(at, p) + 1
    assert ring_segments(64 << 20, p) == (16 << 20) // PIPELINE_SEGMENT
    assert ring_segments(2 * PAIR_MIN_CHUNK - 8, 2) == 1
    assert ring_segments(2 * PAIR_MIN_CHUNK, 2) == PAIR_MIN_CHUNK // PAIR_SEGMENT
    assert ring_segments(64 << 20, 2) == (32 << 20) // PAIR_SEGMENT
    assert ring_segments(1 << 20, p, segment_bytes=1 << 16) == 4  # 256 KiB chunks
    assert ring_segments(1 << 20, p, segment_bytes=1 << 20) == 1  # chunk fits one segment


def test_ring_bandwidth_term_is_bounded_in_p():
    """With no latency, the ring's time approaches 2n*beta + n*gamma from below as p grows;
    the naive one grows linearly in p."""
    bw = CostModel(alpha=0.0, beta=1e-9, gamma=0.0)
    n = 1 << 30
    ring = [bw.ring_all_reduce(n, p) for p in (2, 4, 8, 64, 1024)]
    assert ring == sorted(ring) and ring[-1] < 2 * n * 1e-9
    assert bw.naive_all_reduce(n, 1024) == pytest.approx(2 * 1023 * n * 1e-9)


def test_tree_formula_power_of_two_and_not():
    n = 1000
    one_round = 1e-5 + n * 1e-9 + n * 2e-10
    assert M.tree_all_reduce(n, 8) == pytest.approx(3 * one_round)
    # 6 ranks: fold 2 into their partners, 2 rounds among 4, unfold
    fold = 2 * (1e-5 + n * 1e-9) + n * 2e-10
    assert M.tree_all_reduce(n, 6) == pytest.approx(2 * one_round + fold)
    assert M.tree_broadcast(n, 5) == pytest.approx(3 * (1e-5 + n * 1e-9))


def test_single_rank_costs_nothing():
    for a in ("ring_all_reduce", "tree_all_reduce", "naive_all_reduce"):
        assert M.predict(a, 1 << 20, 1) == 0.0


def test_crossover_small_tree_large_ring():
    assert M.predict("tree_all_reduce", 1 << 10, 16) < M.predict("ring_all_reduce", 1 << 10, 16)
    assert M.predict("ring_all_reduce", 1 << 28, 16) < M.predict("tree_all_reduce", 1 << 28, 16)


def test_fit_recovers_known_parameters_exactly():
    sizes = [1 << k for k in range(10, 27, 2)]
    times = [3e-5 + s * 7e-10 for s in sizes]
    alpha, beta = fit_line(sizes, times)
    assert alpha == pytest.approx(3e-5, rel=1e-9)
    assert beta == pytest.approx(7e-10, rel=1e-9)


def test_fit_lines_finds_a_break_in_the_link_and_prices_each_side():
    """Faster per byte up to 512 KiB (as loopback is here while buffers stay in cache)."""
    sizes = [1 << k for k in range(14, 26)]  # 16 KiB .. 32 MiB
    small_line, large_line = (2e-5, 4e-10), (1e-4, 8e-10)
    times = [(small_line if s <= 512 << 10 else large_line)[0]
             + s * (small_line if s <= 512 << 10 else large_line)[1] for s in sizes]
    (alpha, beta), small = fit_lines(sizes, times)
    assert small is not None and small[0] == 512 << 10
    assert small[1:] == pytest.approx(small_line, rel=1e-6)
    assert (alpha, beta) == pytest.approx(large_line, rel=1e-6)
    model = CostModel(alpha, beta, 0.0, small)
    for s, t in zip(sizes, times, strict=True):
        assert model.ring_all_gather(2 * s, 2) == pytest.approx(t, rel=1e-6)  # one message of s
    # A single line fitted to the same data misses the small messages by far more.
    one = CostModel(*fit_line(sizes, times))
    assert max(abs(one.ring_all_gather(2 * s, 2) / t - 1) for s, t in zip(sizes, times,
                                                                             strict=True)) > 0.2


def test_fit_lines_keeps_one_line_when_a_second_does_not_earn_its_parameters():
    sizes = [1 << k for k in range(14, 26)]
    wobble = [1.0 + 0.02 * (-1) ** i for i in range(len(sizes))]  # +-2%, no break
    times = [(3e-5 + s * 7e-10) * w for s, w in zip(sizes, wobble, strict=True)]
    (alpha, beta), small = fit_lines(sizes, times)
    assert small is None
    assert (alpha, beta) == fit_line(sizes, times)
    # Too few sizes for three on each side: one line, whatever the data.
    (_, _), small = fit_lines([1, 2, 3, 4, 5], [1.0, 1.0, 1.0, 9.0, 9.0])
    assert small is None
    with pytest.raises(MicroDDPError, match="min_side"):
        fit_lines(sizes, times, min_side=2)


def test_fit_lines_rarely_finds_a_break_in_a_noisy_straight_line():
    """The best of several splits fits noise too: a fixed Akaike threshold (a gain of 6)
    kept a second line in about half of these; the simulated one should in about 1 in 20."""
    import random

    sizes = [1 << k for k in range(17, 26)]  # 9 sizes, as the benchmark's 2-rank runs
    kept = gains_over_6 = 0
    for seed in range(40):
        rng = random.Random(seed)
        times = [(5e-5 + s * 8e-10) * (1 + 0.03 * rng.gauss(0, 1)) for s in sizes]
        kept += fit_lines(sizes, times)[1] is not None
        one = fit_line(sizes, times, nonnegative=True)
        gains_over_6 += cost._split_gain(sizes, times, one, 3)[0] > 6
    assert kept <= 5  # about 2 expected; deterministic, the seeds are fixed
    assert gains_over_6 >= 12  # the old rule would have kept these: the test can tell them apart


def test_fit_lines_never_returns_a_negative_latency():
    sizes = [1 << k for k in range(14, 24)]
    times = [s * 1e-9 - 2e-6 for s in sizes]  # a line through these crosses zero below 2 KiB
    assert fit_line(sizes, times)[0] < 0  # the unconstrained fit does go negative
    (alpha, beta), small = fit_lines(sizes, times)
    alphas = [alpha] + ([small[1]] if small else [])
    assert min(alphas) == 0.0  # the line that wanted a negative alpha got zero
    assert beta == pytest.approx(1e-9, rel=0.05)
    model = CostModel(alpha, beta, 0.0, small)
    for s, t in zip(sizes, times, strict=True):  # still close where the data are
        assert model.ring_all_gather(2 * s, 2) == pytest.approx(t, rel=0.15)


def test_fit_lines_never_returns_a_negative_cost_per_byte():
    sizes = [1 << k for k in range(10, 20)]
    times = [1e-4 - s * 1e-12 for s in sizes]  # flat, drifting down: noise at small sizes
    assert fit_line(sizes, times)[1] < 0
    (alpha, beta), small = fit_lines(sizes, times)
    betas = [beta] + ([small[2]] if small else [])
    assert min(betas) == 0.0  # the line that wanted a negative beta got a flat one
    model = CostModel(alpha, beta, 0.0, small)
    for s, t in zip(sizes, times, strict=True):
        assert model.ring_all_gather(2 * s, 2) == pytest.approx(t, rel=0.01)


def test_fit_rejects_unusable_data():
    with pytest.raises(MicroDDPError, match="two different sizes"):
        fit_line([1024, 1024], [1.0, 2.0])
    with pytest.raises(MicroDDPError, match="positive"):
        fit_line([1, 2], [0.0, 1.0])
    with pytest.raises(MicroDDPError, match="positive"):
        fit_lines([1, 2, 3, 4, 5, 6], [1.0, 1.0, 1.0, 2.0, 2.0, -1.0])
    with pytest.raises(MicroDDPError, match="no cost model"):
        M.predict("bogus", 1, 2)


def _sent(world, nbytes: int) -> dict:
    """Bytes this rank sends in each algorithm for an `nbytes` problem, in the model's terms:
    for reduce-scatter, all-gather, scatter and gather, nbytes is the whole (p parts)."""
    p = world.world_size
    x, part = torch.ones(nbytes // 4), torch.ones(nbytes // 4 // p)
    calls = {
        "ring_all_reduce": lambda: C.ring_all_reduce(x.clone(), check=False),
        "tree_all_reduce": lambda: C.tree_all_reduce(x.clone(), check=False),
        "naive_all_reduce": lambda: C.naive_all_reduce(x.clone(), check=False),
        "ring_reduce_scatter": lambda: C.ring_reduce_scatter(torch.empty_like(part), [part] * p,
                                                             check=False),
        "ring_all_gather": lambda: C.ring_all_gather([torch.empty_like(part) for _ in range(p)],
                                                     part, check=False),
        "tree_broadcast": lambda: C.tree_broadcast(x.clone(), 0, check=False),
        "tree_reduce": lambda: C.tree_reduce(x.clone(), 0, check=False),
        "scatter": lambda: C.scatter(torch.empty_like(part),
                                     [part] * p if world.rank == 0 else None, 0, check=False),
        "gather": lambda: C.gather(part, [torch.empty_like(part) for _ in range(p)]
                                   if world.rank == 0 else None, 0, check=False),
    }
    out = {}
    for name, call in calls.items():
        with C.traffic() as t:
            call()
        out[name] = t.bytes
    return out


@pytest.mark.parametrize("p", [2, 3, 4, 6])
def test_model_counts_the_bytes_the_algorithms_send(p):
    nbytes = 4 * 3000  # divisible by every p here, so the ring's chunks are exact
    per_rank = microddp.launch.spawn(_sent, p, (nbytes,), timeout=90)
    assert set(per_rank[0]) == set(ALGORITHMS)  # every modelled algorithm is measured
    for a in ALGORITHMS:
        busiest = max(r[a] for r in per_rank)
        assert busiest == pytest.approx(bytes_sent(a, nbytes, p), rel=1e-12), a
    assert math.isclose(per_rank[0]["ring_all_reduce"], 2 * (p - 1) / p * nbytes)


def test_bench_size_parsing_and_repeats():
    assert [parse_size(s) for s in ("4096", "64K", "1M", "2MiB")] == [4096, 65536, 1 << 20,
                                                                      2 << 20]
    for bad in ("", "x", "-1K", "0"):
        with pytest.raises(MicroDDPError, match="positive number of bytes"):
            parse_size(bad)
    assert repeats_for(1 << 10, 30, 9) == 30
    assert repeats_for(4 << 20, 30, 9) == 9
    assert repeats_for(2 << 20, 30, 5) == 15


def test_bench_table_shows_the_control_ratio_and_intervals():
    from microddp.bench.allreduce_report import CONTROL, table

    times = {"gloo": [1.0, 1.0, 1.0], CONTROL: [1.1, 1.1, 1.1], "ring": [2.0, 2.0, 2.0]}
    report = table([{"bytes": 1 << 20, "times": times}], ["ring"], M, 2)
    control = [line for line in report["lines"] if CONTROL in line]
    # ratio, then the bootstrap interval: no scatter at all, so it is the ratio itself
    assert len(control) == 1 and control[0].split()[-2:] == ["1.10", "1.10-1.10"]
    rec = report["records"][0]
    assert rec["control_vs_gloo"] == pytest.approx(1.1)
    assert rec["ring_vs_gloo"] == pytest.approx(2.0)
    assert rec["ring_vs_gloo_interval"] == pytest.approx([2.0, 2.0])
    without = table([{"bytes": 1 << 20, "times": {"gloo": [1.0], "ring": [2.0]}}], ["ring"], M, 2)
    assert "control_vs_gloo" not in without["records"][0]
