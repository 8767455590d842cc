"""The interleaved timer: every contender timed equally often, in an order that varies from
round to round (so no contender always follows the same one) but is the same on every rank."""

from microddp.bench.timing import interleaved, ratio_of_medians


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
