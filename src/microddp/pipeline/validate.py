"""Check a schedule without running it, so a wrong schedule fails before any rank starts.

The rules, each named in the error when it is broken (with the rank and the action):
- 'well formed': a known kind, a micro-batch in 0..m-1, a stage that lives on this rank;
- 'complete': every stage runs F once per micro-batch, and B once, or I and W once each;
- 'micro-batches in order': a stage runs its F (and its B, I, W) for micro-batches 0, 1, 2...;
- 'input before forward': F has its input (the batch, a receive, or the stage below on this
  rank) and 'gradient before backward' likewise for B and I; 'forward before backward';
  'W after I'; 'send after compute': a send ships something already computed;
- 'matched': every receive has exactly one send with the same kind and micro-batch from the
  neighbouring stage, and every send a receive;
- 'no deadlock' (sends never block, receives do: microddp.pipeline.simulate plays it);
- 'previous stage first': on the played timeline a stage never starts a micro-batch's forward
  before the stage below finished it (nor its backward before the stage above).
"""

from __future__ import annotations

from collections import Counter

from ..errors import MicroDDPError
from .schedules import COMPUTE, KINDS, RECVS, SENDS, Action, Schedule, message_key, peer_stage
from .simulate import Timeline, simulate


def _fail(schedule: Schedule, rank: int, index: int | None, action: Action | None, rule: str,
          why: str) -> MicroDDPError:
    where = f"rank {rank}" + (f", action {index} {action}" if action is not None else "")
    return MicroDDPError(f"schedule {schedule.name}: {where}: rule '{rule}' broken: {why}")


def _check_rank(schedule: Schedule, r: int) -> None:
    p, m, last = schedule.ranks, schedule.microbatches, schedule.stages - 1
    seen: set[tuple[str, int, int]] = set()  # (kind, stage, mb) done so far on this rank
    runs: Counter = Counter()  # (kind, stage) -> how many micro-batches so far
    for i, a in enumerate(schedule.actions[r]):
        def fail(rule: str, why: str, i: int = i, a: Action = a) -> MicroDDPError:
            return _fail(schedule, r, i, a, rule, why)

        if (a.kind not in KINDS or a.rank != r or not 0 <= a.mb < m
                or not 0 <= a.stage <= last or schedule.rank_of(a.stage) != r or a.virtual != a.stage // p):
            raise fail("well formed", f"kinds are {', '.join(KINDS)}, micro-batches 0..{m - 1}, "
                       f"and rank {r} holds stages {schedule.stages_of(r)}")
        s, mb = a.stage, a.mb
        if a.kind in COMPUTE:
            if (a.kind, s, mb) in seen:
                raise fail("complete", "this action appears twice")
            if a.kind in ("B", "I") and any((k, s, mb) in seen for k in ("B", "I")):
                raise fail("complete", "a micro-batch gets either B, or I then W, once")
            if a.kind == "W" and ("B", s, mb) in seen:
                raise fail("complete", "W after a full B would count the weight gradient twice")
            order_kind = "B" if a.kind == "I" else a.kind  # I and B share the backward order
            if runs[order_kind, s] != mb:
                raise fail("micro-batches in order",
                           f"stage {s} must run micro-batch {runs[order_kind, s]} first")
            runs[order_kind, s] += 1
        local_below = s > 0 and schedule.rank_of(s - 1) == r
        local_above = s < last and schedule.rank_of(s + 1) == r
        if a.kind == "F" and s > 0:
            has = ("F", s - 1, mb) in seen if local_below else ("RECV_ACT", s, mb) in seen
            if not has:
                raise fail("input before forward", "its input was neither received nor "
                           "computed on this rank earlier")
        if a.kind in ("B", "I"):
            if ("F", s, mb) not in seen:
                raise fail("forward before backward", "this micro-batch's forward comes later")
            if s < last:
                has = (any((k, s + 1, mb) in seen for k in ("B", "I")) if local_above
                       else ("RECV_GRAD", s, mb) in seen)
                if not has:
                    raise fail("gradient before backward", "the gradient of its output was "
                               "neither received nor computed on this rank earlier")
        if a.kind == "W" and ("I", s, mb) not in seen:
            raise fail("W after I", "the weight gradient needs this micro-batch's I first")
        if a.kind in SENDS or a.kind in RECVS:
            peer = peer_stage(a)
            if not 0 <= peer <= last or schedule.rank_of(peer) == r:
                raise fail("matched", f"stage {s} has no neighbour stage {peer} on another rank")
        if a.kind == "SEND_ACT" and ("F", s, mb) not in seen:
            raise fail("send after compute", "the activation is sent before F computed it")
        if a.kind == "SEND_GRAD" and not any((k, s, mb) in seen for k in ("B", "I")):
            raise fail("send after compute", "the gradient is sent before B or I computed it")
        seen.add((a.kind, s, mb))
    for s in schedule.stages_of(r):
        split = any(("I", s, mb) in seen for mb in range(m))
        for kind in ("F", "B", "W") if split else ("F", "B"):
            if runs[kind, s] != m:
                raise _fail(schedule, r, None, None, "complete",
                            f"stage {s} runs {kind if kind != 'B' else 'B or I'} for "
                            f"{runs[kind, s]} of {m} micro-batches")


def _check_matching(schedule: Schedule) -> None:
    sends: dict[tuple, list] = {}
    recvs: dict[tuple, list] = {}
    for r, program in enumerate(schedule.actions):
        for i, a in enumerate(program):
            if a.kind in SENDS or a.kind in RECVS:
                book = sends if a.kind in SENDS else recvs
                book.setdefault(message_key(a), []).append((r, i, a))
    for book, other, what in ((recvs, sends, "send"), (sends, recvs, "receive")):
        for key, found in book.items():
            r, i, a = found[0]
            if len(found) > 1:
                raise _fail(schedule, r, i, a, "matched", f"{len(found)} actions move the same "
                            "message; each moves once")
            if key not in other:
                raise _fail(schedule, r, i, a, "matched", f"no rank posts the matching {what} "
                            f"({key[0]} across the boundary of stages {key[1]} and {key[1] + 1}, "
                            f"micro-batch {key[2]})")


def _check_causality(schedule: Schedule, timeline: Timeline) -> None:
    when = {(a.kind, a.stage, a.mb): (start, end, r, a)
            for r, spans in enumerate(timeline.spans) for start, end, a in spans}
    for (kind, s, mb), (start, _, r, a) in when.items():
        before = [("F", s - 1, mb)] if kind == "F" else \
                 [("B", s + 1, mb), ("I", s + 1, mb)] if kind in ("B", "I") else []
        for dep in before:
            if dep in when and when[dep][1] > start:
                _, end, dep_rank, dep_action = when[dep]
                raise _fail(schedule, r, schedule.actions[r].index(a), a, "previous stage first",
                            f"it starts at t={start:g}, before rank {dep_rank}'s {dep_action} "
                            f"ends at t={end:g}")


def validate(schedule: Schedule) -> Timeline:
    """Raise MicroDDPError naming the rank, the action and the rule if `schedule` is wrong;
    return its played timeline if it is right."""
    if len(schedule.actions) != schedule.ranks:
        raise _fail(schedule, len(schedule.actions), None, None, "well formed",
                    f"{len(schedule.actions)} programs for {schedule.ranks} ranks")
    for r in range(schedule.ranks):
        _check_rank(schedule, r)
    _check_matching(schedule)
    timeline = simulate(schedule)
    _check_causality(schedule, timeline)
    return timeline
