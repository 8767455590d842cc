"""Interleaved zero bubble: interleaved 1F1B's order with each backward split into I and W.

Each rank holds v stages (rank r: r, r+p, ...) as in interleaved 1F1B and takes its forwards
and its input-gradient halves (I) in the same Megatron-LM order, with the same bound on the
micro-batches in flight; the weight-gradient halves (W), which no other rank waits for, run
only when the rank has nothing else ready, oldest first, so they fill the slots where
interleaved 1F1B would sit idle. This is the schedule behind the torch-shaped
`ScheduleInterleavedZeroBubble` (torch's own builds its ZB1P order differently; the
gradients are the same). Played in unit time steps like the others, so it cannot deadlock;
any p >= 1, m >= 1, v >= 2.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import MicroDDPError
from .schedules import Op, Schedule, _check, _play, _with_comms, megatron_orders


def interleaved_zero_bubble(p: int, m: int, v: int = 2) -> Schedule:
    """The interleaved zero-bubble schedule for p ranks, m micro-batches, v stages per rank."""
    _check(p, m, v)
    if v < 2:
        raise MicroDDPError(f"interleaved zero bubble needs v >= 2 stages per rank, got {v}; "
                            "with one stage per rank use the zero-bubble schedule")
    forwards, inputs, limit = megatron_orders(p, m, v, "I")
    nf, ni = [0] * p, [0] * p
    weights: list[list[Op]] = [[] for _ in range(p)]  # I done, W not yet: oldest first

    def pick(r: int, ready: Callable[[Op], bool]) -> Op | None:
        if nf[r] < m * v and nf[r] - ni[r] < limit[r] and ready(forwards[r][nf[r]]):
            nf[r] += 1
            return forwards[r][nf[r] - 1]
        if ni[r] < nf[r] and ready(inputs[r][ni[r]]):
            ni[r] += 1
            _, s, mb = inputs[r][ni[r] - 1]
            weights[r].append(("W", s, mb))
            return inputs[r][ni[r] - 1]
        if weights[r] and ready(weights[r][0]):
            return weights[r].pop(0)
        return None

    return _with_comms("interleaved-zero-bubble", p, m, v, _play(p, v, m, "I", pick))
