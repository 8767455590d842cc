"""The interleaved timer: every contender timed equally often, in an order that varies from
round to round (so no contender always follows the same one) but is the same on every rank."""

import random
import statistics

import pytest

from microddp.timing import (
    compare,
    interleaved,
    ratio_interval,
    ratio_of_medians,
    trimmed_mean,
)


def record_order(repeats=40, warmup=2):
    calls = []
    contenders = {name: (lambda n=name: calls.append(n)) for name in ("a", "b", "c")}
    times = interleaved(contenders, repeats, warmup)
    return calls, times


def test_each_contender_is_timed_repeats_times_and_follows_every_other():
    calls, times = record_order()
    assert {k: len(v) for k, v in times.items()} == {"a": 40, "b": 40, "c": 40}
    assert len(calls) == 3 * 42
    pairs = [(x, y) for x, y in zip(calls, calls[1:], strict=False) if x != y]
    count = {(x, y): pairs.count((x, y)) for x in "abc" for y in "abc" if x != y}
    # as often after one contender as after another (a rotating order would put "a" before
    # "b" twice as often as "b" before "a")
    for (x, y), n in count.items():
        assert 2 / 3 <= n / count[(y, x)] <= 3 / 2, count


def test_the_order_is_the_same_in_every_process():
    # ranks run the contenders' collectives in lockstep: their orders must agree
    assert record_order()[0] == record_order()[0]


def test_ratio_of_medians():
    assert ratio_of_medians([1, 2, 9], [2, 4, 4]) == 0.5


def test_trimmed_mean_drops_a_tenth_at_each_end():
    xs = [10.0] * 8 + [0.0, 1000.0]  # one stall and one impossible zero: both dropped
    assert trimmed_mean(xs) == 10.0
    assert trimmed_mean(xs, cut=0.0) == pytest.approx(sum(xs) / 10)
    assert trimmed_mean([10.0] * 8 + [1000.0]) == 10.0  # 0.9 of a call rounds to one
    assert trimmed_mean([3.0]) == 3.0 and trimmed_mean([1.0, 2.0]) == 1.5  # nothing to drop
    # A wide cut that would round away every value keeps the middle one or two.
    assert trimmed_mean([1.0, 2.0], 0.25) == 1.5 and trimmed_mean([1.0, 2.0, 9.0, 4.0], 0.4) == 3.0


def test_trimmed_mean_follows_a_two_mode_mixture_where_the_median_jumps():
    # Calls that take 3 or 6 ms: as the slow share goes from 45% to 55%, the median jumps
    # from one group to the other and the trimmed mean moves by an eighth of the gap.
    fast, slow = [3.0] * 55 + [6.0] * 45, [3.0] * 45 + [6.0] * 55
    assert (statistics.median(fast), statistics.median(slow)) == (3.0, 6.0)
    assert trimmed_mean(slow) - trimmed_mean(fast) == pytest.approx(0.375)


@pytest.mark.parametrize("xs, cut", [([], 0.1), ([1.0], 0.5), ([1.0], -0.1)])
def test_trimmed_mean_refuses_bad_input(xs, cut):
    with pytest.raises(ValueError, match="0 <= cut < 0.5"):
        trimmed_mean(xs, cut)


def drifting_times(n, ratio, seed, noise=0.05):
    """Times of two contenders over n rounds: a load that drifts slowly hits both alike in a
    round (as interleaving makes it), plus each call's own noise."""
    rng = random.Random(seed)
    load = [1 + 0.5 * abs(((i / n) * 4) % 2 - 1) for i in range(n)]  # a triangle wave
    b = [x * (1 + rng.gauss(0, noise)) for x in load]
    a = [ratio * x * (1 + rng.gauss(0, noise)) for x in load]
    return a, b


def test_ratio_interval_without_scatter_is_the_ratio_itself():
    assert ratio_interval([2.0] * 5, [1.0] * 5) == pytest.approx((2.0, 2.0))


def test_ratio_interval_holds_the_true_ratio_and_narrows_with_more_rounds():
    a, b = drifting_times(400, 1.2, seed=1)
    lo, hi = ratio_interval(a, b)
    assert lo < 1.2 < hi and lo < ratio_of_medians(a, b) < hi
    few = ratio_interval(*drifting_times(40, 1.2, seed=1))
    assert few[1] - few[0] > 1.5 * (hi - lo)


def test_ratio_interval_pairs_the_rounds():
    # The drift is shared within a round: resampled whole rounds see only the calls' own noise.
    # Unpaired (a's rounds shuffled against b's), the drift widens it.
    a, b = drifting_times(300, 1.1, seed=2)
    lo, hi = ratio_interval(a, b)
    shuffled = a[:]
    random.Random(0).shuffle(shuffled)
    ulo, uhi = ratio_interval(shuffled, b)
    assert hi - lo < (uhi - ulo) / 1.5


@pytest.mark.slow  # many repeated trials to estimate a rate: for CI's slow run
def test_ratio_interval_of_equal_contenders_holds_1_about_as_often_as_its_level():
    # An A/A comparison with independent, skewed call times: over many simulated runs, a 90%
    # interval should miss 1 about 1 time in 10; far fewer misses would mean it is uselessly
    # wide, far more that it is too narrow to trust.
    def run(seed):
        rng = random.Random(seed)
        return ([rng.lognormvariate(0, 0.2) for _ in range(100)],
                [rng.lognormvariate(0, 0.2) for _ in range(100)])

    held = 0
    for seed in range(200):
        lo, hi = ratio_interval(*run(seed), resamples=500)
        held += lo <= 1.0 <= hi
    assert 0.8 * 200 <= held <= 0.97 * 200, held


def test_ratio_interval_refuses_unpaired_lists():
    with pytest.raises(ValueError, match="equally long"):
        ratio_interval([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="equally long"):
        ratio_interval([], [])


def test_compare_is_the_ratio_with_its_interval():
    a, b = drifting_times(200, 1.3, seed=3)
    assert compare(a, b) == (ratio_of_medians(a, b), ratio_interval(a, b))
