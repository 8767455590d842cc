"""An alpha-beta-gamma cost model of each collective: predicted seconds for n bytes on p ranks.

alpha is the fixed cost of one message (latency), beta the cost of moving one byte (inverse
bandwidth), gamma the cost of reducing one byte (an add). Every algorithm is a number of
rounds, each a message of some size: counting them is the whole model, and it says which
algorithm to use for which size before anything is measured. Rounds add up, so a
prediction is a mean time per call: where calls take one of two times, hold it to a mean,
not a median (`microddp bench allreduce` prints both and judges the model on the mean;
chapter 4 says why).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import MicroDDPError

ALGORITHMS = ("ring_all_reduce", "tree_all_reduce", "naive_all_reduce", "ring_reduce_scatter",
              "ring_all_gather", "tree_broadcast", "tree_reduce", "scatter", "gather")


@dataclass(frozen=True)
class CostModel:
    """Seconds per message (alpha), per byte sent (beta), per byte reduced (gamma).

    `small`, if given, is `(up_to_bytes, alpha, beta)`: a second line for messages of at most
    that many bytes. A real link is not one straight line: on this machine's loopback, a
    message whose buffers fit in a core's cache moves faster per byte than a larger one
    (`fit_lines` finds the break when the data show one).
    """

    alpha: float
    beta: float
    gamma: float = 0.0
    small: tuple[float, float, float] | None = None

    def _msg(self, nbytes: float) -> float:
        if self.small is not None and nbytes <= self.small[0]:
            return self.small[1] + nbytes * self.small[2]
        return self.alpha + nbytes * self.beta

    def ring_all_reduce(self, n: float, p: int, segments: int = 1) -> float:
        """2(p-1) steps of n/p bytes, and (p-1) reductions of n/p bytes on each rank.

        Pipelined in k `segments` per chunk, each rank's link still carries the same bytes,
        but a segment travels while the one before it is added, and its latency passes while
        the ones before it are still on the wire: per step one latency and one segment's add
        stay on the critical path. (Each message's own CPU cost, not modelled, is why the ring
        pipelines only large chunks.)
        """
        if p <= 1:
            return 0.0
        chunk = n / p
        return 2 * (p - 1) * self._msg(chunk) + (p - 1) * (chunk / max(1, segments)) * self.gamma

    def ring_reduce_scatter(self, n: float, p: int) -> float:
        """The first half of the ring all-reduce (n = bytes of the whole input)."""
        return (p - 1) * (self._msg(n / p) + (n / p) * self.gamma) if p > 1 else 0.0

    def ring_all_gather(self, n: float, p: int) -> float:
        """The second half (n = bytes of the gathered result)."""
        return (p - 1) * self._msg(n / p) if p > 1 else 0.0

    def tree_all_reduce(self, n: float, p: int) -> float:
        """log2 of the largest power of two <= p full exchanges, plus a fold and an unfold
        when p is not a power of two."""
        if p <= 1:
            return 0.0
        pof2 = 1 << (p.bit_length() - 1)
        rounds = int(math.log2(pof2))
        extra = 2 * self._msg(n) + n * self.gamma if pof2 != p else 0.0
        return rounds * (self._msg(n) + n * self.gamma) + extra

    def naive_all_reduce(self, n: float, p: int) -> float:
        """The root receives p-1 tensors one by one, reduces them, sends p-1 back."""
        return 2 * (p - 1) * self._msg(n) + (p - 1) * n * self.gamma

    def tree_broadcast(self, n: float, p: int) -> float:
        """Seconds to broadcast `n` bytes down a binary tree of `p` ranks: ceil(log2 p) full
        messages."""
        return _ceil_log2(p) * self._msg(n)

    def tree_reduce(self, n: float, p: int) -> float:
        """Seconds to reduce `n` bytes up a binary tree of `p` ranks: ceil(log2 p) messages,
        each also summed."""
        return _ceil_log2(p) * (self._msg(n) + n * self.gamma)

    def scatter(self, n: float, p: int) -> float:
        """The root sends p-1 parts of n/p bytes (n = bytes of all parts together)."""
        return (p - 1) * self._msg(n / p)

    def gather(self, n: float, p: int) -> float:
        """The root receives p-1 parts of n/p bytes (n = bytes of all parts together)."""
        return (p - 1) * self._msg(n / p)

    def shm_all_reduce(self, n: float, p: int, slot: float = 4 << 20,
                       small: float | None = None) -> float:
        """Through shared memory (shm/group.py), where alpha is one synchronisation (a wait
        on the peers' counters), beta the cost of copying a byte, gamma of reducing one. In
        pieces of at most `slot` bytes; a piece up to `small` bytes (default: the slot on 2
        ranks, 64 KiB on more, as shm_group.sizes) takes one synchronisation, one copy in
        and p-1 reductions of the piece; a larger one two synchronisations, a copy in and one
        out, and p-1 reductions of its n/p slice."""
        if p <= 1:
            return 0.0
        if small is None:
            small = slot if p == 2 else 64 << 10

        def piece(m: float) -> float:
            if m <= small:
                return self.alpha + m * self.beta + (p - 1) * m * self.gamma
            return 2 * self.alpha + 2 * m * self.beta + (p - 1) * m / p * self.gamma

        whole, rest = divmod(n, slot) if n > slot else (0, n)
        return whole * piece(slot) + (piece(rest) if rest else 0.0)

    def predict(self, algorithm: str, nbytes: float, p: int, **options) -> float:
        """Predicted seconds for `algorithm` (a name from ALGORITHMS, or shm_all_reduce) on
        `nbytes` and `p` ranks; `options` go to the algorithm's own method (the ring's
        `segments`)."""
        if algorithm not in (*ALGORITHMS, "shm_all_reduce"):
            raise MicroDDPError(f"no cost model for {algorithm!r}; choose one of "
                                f"{', '.join(ALGORITHMS)}, shm_all_reduce")
        if p < 1 or nbytes < 0:
            raise MicroDDPError(f"need p >= 1 ranks and nbytes >= 0, got p={p}, nbytes={nbytes}")
        return getattr(self, algorithm)(float(nbytes), p, **options)


def ring_all_reduce_bytes(numel: int, p: int, element_size: int) -> int:
    """Bytes each rank sends in a ring all-reduce of `numel` elements on `p` ranks: 2(p - 1)
    chunks of ceil(numel / p) elements (a reduce-scatter, then an all-gather). The one rule
    every counter of a ring's traffic uses (the strategies' `sent_per_step`, ZeRO's
    CountingAllReduce); `bytes_sent` below is its bandwidth term, n / p for ceil."""
    if p < 2 or numel == 0:
        return 0
    return 2 * (p - 1) * -(-numel // p) * element_size


def bytes_sent(algorithm: str, n: float, p: int) -> float:
    """Bytes the busiest rank sends for an n-byte tensor on p ranks: the bandwidth term."""
    if algorithm not in ALGORITHMS:
        raise MicroDDPError(f"unknown algorithm {algorithm!r}; choose one of "
                            f"{', '.join(ALGORITHMS)}")
    if p <= 1:
        return 0.0
    pof2 = 1 << (p.bit_length() - 1)
    return {
        "ring_all_reduce": 2 * (p - 1) * n / p,
        "tree_all_reduce": math.log2(pof2) * n + (n if pof2 != p else 0.0),
        "naive_all_reduce": (p - 1) * n,
        "ring_reduce_scatter": (p - 1) * n / p,
        "ring_all_gather": (p - 1) * n / p,
        "tree_broadcast": _ceil_log2(p) * n,  # the root sends to one subtree per round
        "tree_reduce": n,
        "scatter": (p - 1) * n / p,
        "gather": n / p,
    }[algorithm]


def _ceil_log2(p: int) -> int:
    return (p - 1).bit_length() if p > 1 else 0


def fit_line(sizes: Sequence[float], times: Sequence[float],
             nonnegative: bool = False) -> tuple[float, float]:
    """(intercept, slope) of time = intercept + slope * size, minimising *relative* error.

    Plain least squares would let the largest sizes decide everything and leave the
    intercept (the latency) meaningless; weighting each point by 1/time fits small and
    large messages alike. `nonnegative` keeps both >= 0 (the best such line).
    """
    _check_points(sizes, times)
    return _weighted_line(sizes, times, nonnegative)


def _check_points(sizes: Sequence[float], times: Sequence[float]) -> None:
    if len(sizes) != len(times) or len(sizes) < 2 or len(set(sizes)) < 2:
        raise MicroDDPError("fitting needs at least two different sizes, one time per size")
    if min(times) <= 0:
        raise MicroDDPError("fitting needs positive times")


def _weighted_line(sizes: Sequence[float], times: Sequence[float],
                   nonnegative: bool = False) -> tuple[float, float]:
    # Weighted normal equations for weights w = 1/t^2.
    sw = sx = sxx = sy = sxy = 0.0
    for x, t in zip(sizes, times, strict=True):
        w = 1.0 / (t * t)
        sw += w
        sx += w * x
        sxx += w * x * x
        sy += w * t
        sxy += w * x * t
    det = sw * sxx - sx * sx
    slope = (sw * sxy - sx * sy) / det
    intercept = (sy - slope * sx) / sw
    if nonnegative and intercept < 0:
        # No message takes less than no time: the best line through the origin instead (the
        # error is convex, so the best line with intercept >= 0 has it at 0).
        return 0.0, sxy / sxx
    if nonnegative and slope < 0:  # nor does a larger one take less: flat, then
        return sy / sw, 0.0
    return intercept, slope


def _relative_rss(sizes, times, line: tuple[float, float]) -> float:
    a, b = line
    return sum(((a + b * x) / t - 1.0) ** 2 for x, t in zip(sizes, times, strict=True))


def fit_lines(sizes: Sequence[float], times: Sequence[float], min_side: int = 3
              ) -> tuple[tuple[float, float], tuple[float, float, float] | None]:
    """One line through (size, time), or two with a break between two neighbouring sizes.

    Returns `((alpha, beta), small)`: `small` is None for one line, else `(up_to_bytes,
    alpha, beta)` of the line below the break, as `CostModel(small=...)` takes it. Each side
    needs `min_side` (>= 3) different sizes. Each line's alpha and beta are kept >= 0: a
    negative latency or per-byte cost can fit noisy points, but means nothing.

    Two lines always fit at least as well as one, and the best of several splits fits noise
    too, so the second line must beat chance: its gain, n ln(RSS1 / RSS2) on the squared
    relative error, has to exceed what `NULL_LEVEL` of straight lines with random noise on
    the same sizes get from their own best split (`_null_gain`). A fixed threshold would not
    do: Akaike's 2 per parameter (6) kept a break in 16 of 40 noisy straight lines of nine
    sizes (tests/test_collectives_cost.py), because the break is chosen after looking.
    """
    if min_side < 3:
        raise MicroDDPError(f"min_side must be at least 3 (two points fit any line), got "
                            f"{min_side}")
    _check_points(sizes, times)
    pts = sorted(zip(sizes, times, strict=True))
    xs, ts = [x for x, _ in pts], [t for _, t in pts]
    one = _weighted_line(xs, ts, nonnegative=True)
    gain, best = _split_gain(xs, ts, one, min_side)
    if best is None or gain <= _null_gain(xs, one, min_side):
        return one, None
    up_to, (small, large) = best
    return large, (up_to, *small)


NULL_LEVEL = 0.95  # keep a break only if straight noisy lines gain less 95% of the time
_NULL_TRIALS = 400


def _split_gain(xs: list[float], ts: list[float], one: tuple[float, float], min_side: int):
    """(n ln(RSS1 / RSS2), (last size below the break, (small line, large line))) of the best
    split, or (0.0, None) when no split leaves `min_side` sizes on each side."""
    rss_one = _relative_rss(xs, ts, one)
    best = None
    for cut in range(min_side, len(xs) - min_side + 1):
        lo, hi = (xs[:cut], ts[:cut]), (xs[cut:], ts[cut:])
        if len(set(lo[0])) < min_side or len(set(hi[0])) < min_side or xs[cut - 1] == xs[cut]:
            continue
        lines = _weighted_line(*lo, nonnegative=True), _weighted_line(*hi, nonnegative=True)
        rss = _relative_rss(*lo, lines[0]) + _relative_rss(*hi, lines[1])
        if best is None or rss < best[0]:
            best = (rss, xs[cut - 1], lines)
    if best is None:
        return 0.0, None
    floor = 1e-12 * len(xs)  # relative errors of 1e-6 are rounding, not a second line
    return len(xs) * math.log((rss_one + floor) / (best[0] + floor)), best[1:]


def _null_gain(xs: list[float], one: tuple[float, float], min_side: int) -> float:
    """The NULL_LEVEL quantile of the best split's gain on the straight line `one` with 1%
    Gaussian relative noise at the sizes `xs` (the gain does not depend on the noise's size).
    Seeded, so a fit of the same data always decides the same way."""
    rng = random.Random(0)
    clean = [max(one[0] + one[1] * x, 1e-30) for x in xs]
    gains = []
    for _ in range(_NULL_TRIALS):
        ts = [t * (1.0 + 0.01 * rng.gauss(0.0, 1.0)) for t in clean]
        gains.append(_split_gain(xs, ts, _weighted_line(xs, ts, nonnegative=True), min_side)[0])
    gains.sort()
    return gains[min(len(gains) - 1, int(NULL_LEVEL * len(gains)))]
