"""ZB-V: zero bubble with two stages per rank placed in a V (rank r holds r and 2p-1-r).

A micro-batch goes down the ranks through the first p stages and back up through the last p,
so rank 0 holds both ends: the loss is computed where the batch came in, and a micro-batch's
backward starts on the rank that started its forward. Each backward is split into I (the
input's gradient, which the stage below waits for) and W (the weights', which nobody waits
for). Played in unit time steps like the other schedules, a free rank runs, in order of
preference: the next I that is ready (its second stage's first), the next forward of its
second stage, the next forward of its first stage while fewer than p micro-batches are
between their first forward and their first stage's I on this rank (bounding memory; on paper
p gives the bubble 2p gives, fewer a larger one), else the oldest W. The order is microddp's own greedy one, not the paper's hand-built pattern; the
gradients are the same. Any p >= 1 and m >= 1.
"""

from __future__ import annotations

from collections.abc import Callable

from .schedules import Op, Schedule, _check, _play, _with_comms, place


def zbv_zero_bubble(p: int, m: int) -> Schedule:
    """The ZB-V schedule for p ranks (2p stages, V placement) and m micro-batches."""
    _check(p, m)
    mine = [[s for s in range(2 * p) if place(s, p, "v") == r] for r in range(p)]
    nf = [{s: 0 for s in stages} for stages in mine]
    ni = [{s: 0 for s in stages} for stages in mine]
    weights: list[list[Op]] = [[] for _ in range(p)]  # I done, W not yet: oldest first

    def pick(r: int, ready: Callable[[Op], bool]) -> Op | None:
        first, second = mine[r]
        for s in (second, first):  # the later stage's backward comes first
            op = ("I", s, ni[r][s])
            if ni[r][s] < nf[r][s] and ready(op):
                ni[r][s] += 1
                weights[r].append(("W", s, op[2]))
                return op
        if nf[r][second] < m and ready(("F", second, nf[r][second])):
            nf[r][second] += 1
            return ("F", second, nf[r][second] - 1)
        if (nf[r][first] < m and nf[r][first] - ni[r][first] < p
                and ready(("F", first, nf[r][first]))):
            nf[r][first] += 1
            return ("F", first, nf[r][first] - 1)
        if weights[r] and ready(weights[r][0]):
            return weights[r].pop(0)
        return None

    # _play plays any placement: each rank's pick chooses among its own stages' ops
    return _with_comms("zbv", p, m, 2, _play(p, 2, m, "I", pick), "v")
