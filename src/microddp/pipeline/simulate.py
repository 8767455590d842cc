"""Play a schedule on paper: when each rank would start and finish each action.

Sends never block (the interpreter posts them with isend); a receive blocks until its send has
been posted. Compute takes a fixed cost (F = 1, B = 2, I = W = 1: a backward costs about two
forwards), messages take no time. The result is the classic rank x time picture, the bubble
on paper, and, if the ranks end up all waiting on each other, the deadlock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import MicroDDPError
from .schedules import RECVS, SENDS, Action, Schedule, message_key

COSTS = {"F": 1, "B": 2, "I": 1, "W": 1}


@dataclass
class Timeline:
    """Per rank, (start, end, action) of every compute action; `makespan`: the step's length."""

    spans: list[list[tuple[float, float, Action]]]
    makespan: float

    @property
    def bubble(self) -> float:
        """The fraction of the ranks' time spent idle during the step."""
        busy = sum(end - start for spans in self.spans for start, end, _ in spans)
        total = self.makespan * len(self.spans)
        return 1 - busy / total if total else 0.0


def simulate(schedule: Schedule, costs: dict[str, float] | Callable[[Action], float] | None = None,
             transfer: float = 0.0, send: float = 0.0, receive: float = 0.0,
             wake: float = 0.0, cores: int | None = None,
             idle: Callable[[Action], float] | None = None) -> Timeline:
    """Run every rank's program in order; raise MicroDDPError naming the stuck ranks if the
    programs deadlock (each rank waits for a receive whose send never comes first).

    `costs`: per kind (F, B, I, W), or a function of the action (stages of unequal size);
    `transfer`: the time a message takes from its send to its receive (0: none, on paper);
    `send`: the time posting a send takes on its sender's own clock (0: none);
    `receive`: the time a receive takes on its receiver's clock once its message is there;
    `wake`: what a receive that waits (its rank got there before the message) pays on top,
    from the message's arrival to its rank running again (0: none).
    `cores`: with fewer cores than ranks, rank r runs on core r mod cores (as
    `placement.pin` places it) and the ranks of one core share it (`_shared`); `idle`: the
    part of an action's cost that holds no core (a sleep), for that sharing.
    """
    costs = COSTS if costs is None else costs
    cost = costs if callable(costs) else (lambda a: costs[a.kind])
    p = schedule.ranks
    if cores is not None and cores < p:
        return _shared(schedule, cost, idle or (lambda a: 0.0), cores,
                       transfer, send, receive, wake)
    pos, clock = [0] * p, [0.0] * p
    posted: dict[tuple, float] = {}  # message key -> when its send was posted
    spans: list[list] = [[] for _ in range(p)]
    moved = True
    while moved:
        moved = False
        for r in range(p):
            program = schedule.actions[r]
            while pos[r] < len(program):
                a = program[pos[r]]
                if a.kind in RECVS:
                    key = message_key(a)
                    if key not in posted:
                        break  # blocked until the sender gets there
                    arrival = posted[key] + transfer
                    clock[r] = (arrival + wake if arrival > clock[r] else clock[r]) + receive
                elif a.kind in SENDS:
                    clock[r] += send
                    posted[message_key(a)] = clock[r]
                else:
                    spans[r].append((clock[r], clock[r] + cost(a), a))
                    clock[r] += cost(a)
                pos[r] += 1
                moved = True
    stuck = [r for r in range(p) if pos[r] < len(schedule.actions[r])]
    if stuck:
        waits = "; ".join(f"rank {r} at action {pos[r]} {schedule.actions[r][pos[r]]}"
                          for r in stuck)
        raise MicroDDPError(f"schedule {schedule.name}: rule 'no deadlock' broken: every "
                            f"unfinished rank waits for a message not yet sent: {waits}; "
                            "reorder the programs so each receive's send comes first")
    return Timeline(spans, max(clock, default=0.0))


def _shared(schedule: Schedule, cost: Callable[[Action], float],
            idle: Callable[[Action], float], cores: int, transfer: float, send: float,
            receive: float, wake: float) -> Timeline:
    """`simulate` with ranks sharing cores: while k ranks of one core need it (computing,
    sending, or a receive's own time), each runs at 1/k of its speed; a rank waiting (for a
    message, its wake-up, or a sleep) needs none. Played as events: at each step every rank's
    current piece of work runs at its speed until the first piece ends."""
    p, programs = schedule.ranks, schedule.actions
    pos = [0] * p
    work: list[list | None] = [None] * p  # [kind, left, action, start]: "cpu" left seconds of
    # core time, "wait" until a time, "sleep" until a time then done
    posted: dict[tuple, float] = {}
    spans: list[list] = [[] for _ in range(p)]
    now = 0.0

    def start(r: int) -> None:
        """Give rank r its next piece of work, if its next action can start now."""
        while work[r] is None and pos[r] < len(programs[r]):
            a = programs[r][pos[r]]
            if a.kind in RECVS:
                key = message_key(a)
                if key not in posted:
                    return  # blocked until the sender gets there
                arrival = posted[key] + transfer
                work[r] = (["wait", arrival + wake, a, now] if arrival > now
                           else ["cpu", receive, a, now])
            elif a.kind in SENDS:
                work[r] = ["cpu", send, a, now]
            else:
                work[r] = ["cpu", cost(a) - idle(a), a, now]

    def finish(r: int) -> None:
        kind, _, a, begun = work[r]
        if kind == "wait":  # the message is there: the receive's own time next
            work[r] = ["cpu", receive, a, begun]
            return
        if kind == "cpu" and a.kind not in RECVS and a.kind not in SENDS and idle(a) > 0:
            work[r] = ["sleep", now + idle(a), a, begun]
            return
        if a.kind in SENDS:
            posted[message_key(a)] = now
        elif a.kind not in RECVS:
            spans[r].append((begun, now, a))
        work[r] = None
        pos[r] += 1

    while True:
        for r in range(p):
            start(r)
        running = [r for r in range(p) if work[r] is not None]
        if not running:
            break
        sharing = [0] * cores
        for r in running:
            sharing[r % cores] += work[r][0] == "cpu"
        speed = {r: 1 / sharing[r % cores] for r in running if work[r][0] == "cpu"}
        step = min((work[r][1] / speed[r] if r in speed else work[r][1] - now)
                   for r in running)
        step = max(step, 0.0)
        now += step
        for r in running:
            if r in speed:
                work[r][1] -= step * speed[r]
        for r in running:
            done = work[r][1] <= 1e-15 if r in speed else work[r][1] <= now + 1e-15
            if done:
                finish(r)
    stuck = [r for r in range(p) if pos[r] < len(programs[r])]
    if stuck:
        waits = "; ".join(f"rank {r} at action {pos[r]} {programs[r][pos[r]]}" for r in stuck)
        raise MicroDDPError(f"schedule {schedule.name}: rule 'no deadlock' broken: every "
                            f"unfinished rank waits for a message not yet sent: {waits}; "
                            "reorder the programs so each receive's send comes first")
    return Timeline(spans, now)


def theory_bubble(schedule: Schedule) -> float:
    """The textbook bubble fraction: (p-1)/(v*m+p-1) for GPipe, 1F1B and interleaved (v = 1
    for the first two; exact for interleaved when p divides m), (p-1)/(3m+p-1) for ZB-H1 with
    F = I = W (its idle time shrinks from (p-1)(F+B) to (p-1)(F+I-W))."""
    p, m, v = schedule.ranks, schedule.microbatches, schedule.virtual
    if schedule.name == "zero-bubble":
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (v * m + p - 1)


def _label(a: Action, virtual: int) -> str:
    suffix = "abcdefghijklmnopqrstuvwxyz"[a.virtual] if virtual > 1 else ""
    return f"{a.kind}{a.mb}{suffix}"


def grid(schedule: Schedule, costs: dict[str, float] | None = None) -> str:
    """The rank x time picture: one column per time unit, '.' where a rank is idle.

    With interleaving, a letter names the rank's stage (a: its first, b: its second, ...).
    """
    timeline = simulate(schedule, costs)
    units = int(round(timeline.makespan))
    rows = []
    for spans in timeline.spans:
        cells = ["."] * units
        for start, end, a in spans:
            for t in range(int(round(start)), int(round(end))):
                cells[t] = _label(a, schedule.virtual)
        rows.append(cells)
    width = max((len(c) for row in rows for c in row), default=1)
    lines = [f"rank {r} | " + " ".join(c.ljust(width) for c in row).rstrip()
             for r, row in enumerate(rows)]
    return "\n".join(lines)
