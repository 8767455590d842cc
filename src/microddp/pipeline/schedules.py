"""Pipeline schedules as data: for every rank, the ordered list of actions it performs.

A schedule is built for all ranks at once, before anything runs, so it can be printed
(`microddp.pipeline.grid`), checked (`microddp.pipeline.validate`) and tested without a single
message; one interpreter (`microddp.pipeline.runtime`) runs any of them.

Stages are numbered 0..p*v-1 along the model. With v virtual stages per rank (interleaving),
rank r holds stages r, r+p, r+2p, ...: stage s lives on rank s % p as its virtual stage s // p
(the "loop" placement; the "v" placement of ZB-V turns every other round back: rank r holds
r and 2p-1-r, so the first and the last stage share rank 0).
The four builders take any p >= 1 ranks and any m >= 1 micro-batches (fewer micro-batches than
stages only makes a bigger bubble, so microddp allows it where torch refuses).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import MicroDDPError

COMPUTE = ("F", "B", "I", "W")  # forward, backward, input-gradient only, weight-gradient only
SENDS = ("SEND_ACT", "SEND_GRAD")
RECVS = ("RECV_ACT", "RECV_GRAD")
KINDS = COMPUTE + SENDS + RECVS


@dataclass(frozen=True)
class Action:
    """One step of one rank: `kind` on micro-batch `mb` at (global) stage `stage`.

    A SEND_ACT sends stage `stage`'s output to stage+1, a RECV_ACT receives stage `stage`'s
    input from stage-1; a SEND_GRAD sends the gradient of stage `stage`'s input to stage-1, a
    RECV_GRAD receives the gradient of its output from stage+1.
    """

    rank: int
    kind: str
    mb: int
    stage: int
    virtual: int = 0  # which of the rank's stages: stage // p

    def __str__(self) -> str:
        v = f", virtual {self.virtual}" if self.virtual else ""
        return f"{self.kind}(stage {self.stage}{v}, micro-batch {self.mb})"


@dataclass(frozen=True)
class Schedule:
    """`actions[r]` is rank r's program; p ranks, m micro-batches, v stages per rank."""

    name: str
    ranks: int
    microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    virtual: int = 1
    placement: str = "loop"  # or "v": see the module docstring

    @property
    def stages(self) -> int:
        """Stages in all: ranks times virtual stages per rank."""
        return self.ranks * self.virtual

    def rank_of(self, stage: int) -> int:
        """The rank that runs `stage` (dealt round-robin, or back and forth for "v")."""
        return place(stage, self.ranks, self.placement)

    def stages_of(self, rank: int) -> list[int]:
        """The stages `rank` runs, first to last."""
        return [s for s in range(self.stages) if self.rank_of(s) == rank]

    def peer(self, action: Action) -> int:
        """The rank a send's message goes to, or a receive's comes from."""
        return self.rank_of(peer_stage(action))


def place(stage: int, p: int, placement: str = "loop") -> int:
    """The rank of `stage` among p ranks: stage % p ("loop"), or with every other round of p
    stages dealt backwards ("v": ZB-V's, rank r holds r and 2p-1-r)."""
    k, i = divmod(stage, p)
    return p - 1 - i if placement == "v" and k % 2 else i


def peer_stage(action: Action) -> int:
    """The stage a send's message goes to, or a receive's comes from: activations go up a
    stage (SEND_ACT to stage+1, RECV_ACT from stage-1), gradients come down (SEND_GRAD to
    stage-1, RECV_GRAD from stage+1). It may not exist (a broken schedule's, which
    `validate` refuses)."""
    if action.kind in ("SEND_ACT", "RECV_GRAD"):
        return action.stage + 1
    if action.kind in ("RECV_ACT", "SEND_GRAD"):
        return action.stage - 1
    raise MicroDDPError(f"{action} is not a send or a receive")


def message_key(action: Action) -> tuple[str, int, int]:
    """What a send and its receive have in common: (ACT or GRAD, boundary, micro-batch).

    Boundary b sits between stages b and b+1; activations cross it upwards, gradients down.
    """
    if action.kind == "SEND_ACT":
        return ("ACT", action.stage, action.mb)
    if action.kind == "RECV_ACT":
        return ("ACT", action.stage - 1, action.mb)
    if action.kind == "SEND_GRAD":
        return ("GRAD", action.stage - 1, action.mb)
    if action.kind == "RECV_GRAD":
        return ("GRAD", action.stage, action.mb)
    raise MicroDDPError(f"{action} is not a send or a receive")


def _check(p: int, m: int, v: int = 1) -> None:
    for name, value in (("ranks (stages p)", p), ("micro-batches m", m), ("virtual stages v", v)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise MicroDDPError(f"a pipeline schedule needs {name} >= 1, got {value!r}")


Op = tuple[str, int, int]  # (kind, stage, micro-batch): a compute action before comms are added


def _with_comms(name: str, p: int, m: int, v: int, orders: list[list[Op]],
                placement: str = "loop") -> Schedule:
    """Turn each rank's compute order into its program: a receive right before the compute
    that needs it, a send right after the compute that made it (between stages on different
    ranks only; neighbouring stages on one rank hand tensors over in memory)."""
    last = p * v - 1
    programs = []
    for r, order in enumerate(orders):
        prog: list[Action] = []

        def add(kind: str, s: int, mb: int, r: int = r, prog: list = prog) -> None:
            prog.append(Action(r, kind, mb, s, s // p))

        for kind, s, mb in order:
            below = s > 0 and place(s - 1, p, placement) != r
            above = s < last and place(s + 1, p, placement) != r
            if kind == "F" and below:
                add("RECV_ACT", s, mb)
            if kind in ("B", "I") and above:
                add("RECV_GRAD", s, mb)
            add(kind, s, mb)
            if kind == "F" and above:
                add("SEND_ACT", s, mb)
            if kind in ("B", "I") and below:
                add("SEND_GRAD", s, mb)
        programs.append(tuple(prog))
    return Schedule(name, p, m, tuple(programs), v, placement)


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: every rank runs all m forwards, then all m backwards. Simple, but each rank holds
    the activations of all m micro-batches at once."""
    _check(p, m)
    orders = [[("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)]
              for r in range(p)]
    return _with_comms("gpipe", p, m, 1, orders)


def _one_f_one_b_order(warmup: int, forwards: list, backwards: list) -> list[Op]:
    """`warmup` forwards, then one forward and one backward in turn, then the last backwards."""
    order = list(forwards[:warmup])
    for f, b in zip(forwards[warmup:], backwards, strict=False):
        order += [f, b]
    order += backwards[len(forwards) - warmup:]
    return order


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B: rank r starts p-1-r forwards ahead, then alternates one forward and one backward.
    The same bubble as GPipe, but rank r never holds more than p-r micro-batches' activations."""
    _check(p, m)
    orders = [_one_f_one_b_order(min(p - 1 - r, m), [("F", r, i) for i in range(m)],
                                 [("B", r, i) for i in range(m)]) for r in range(p)]
    return _with_comms("1f1b", p, m, 1, orders)


def _play(p: int, v: int, m: int, backward: str,
          pick: Callable[[int, Callable[[Op], bool]], Op | None]) -> list[list[Op]]:
    """Build compute orders by playing the pipeline in unit time steps (F = I = W = 1, B = 2):
    whenever a rank is free, `pick(rank, ready)` chooses its next op among those whose inputs
    exist by now (or None: stay idle). An order made this way can always run: every op was
    chosen only once what it needs had been computed."""
    last, cost = p * v - 1, {"F": 1, "B": 2, "I": 1, "W": 1}
    done: dict[Op, int] = {}  # op -> the time step it finishes
    orders: list[list[Op]] = [[] for _ in range(p)]
    busy, t, total = [0] * p, 0, p * v * m * (3 if backward == "I" else 2)

    def deps(op: Op) -> list[Op]:
        kind, s, mb = op
        if kind == "F":
            return [("F", s - 1, mb)] if s > 0 else []
        if kind == "W":
            return [("I", s, mb)]
        return [("F", s, mb)] + ([(kind, s + 1, mb)] if s < last else [])

    while len(done) < total:
        if t > 10 * total:
            raise MicroDDPError(f"bug: the {backward} schedule for p={p}, m={m}, v={v} stalls; "
                                "please report it")
        for r in range(p):
            if busy[r] > t:
                continue
            op = pick(r, lambda op, now=t: all(done.get(d, now + 1) <= now for d in deps(op)))
            if op is not None:
                orders[r].append(op)
                done[op] = busy[r] = t + cost[op[0]]
        t += 1
    return orders


def megatron_orders(p: int, m: int, v: int, backward: str
                    ) -> tuple[list[list[Op]], list[list[Op]], list[int]]:
    """Each rank's forwards and its backwards (of kind `backward`, B or I) in Megatron-LM's
    interleaved order, and how many micro-batches it may have in flight (warm-up + 1)."""

    def key(op: Op, reverse: bool) -> tuple[int, int, int]:
        k = op[1] // p
        return (op[2] // p, v - 1 - k if reverse else k, op[2])

    forwards, backwards, limit = [], [], []
    for r in range(p):
        ops = [(s, i) for s in range(r, p * v, p) for i in range(m)]
        forwards.append(sorted((("F", s, i) for s, i in ops), key=lambda o: key(o, False)))
        backwards.append(sorted(((backward, s, i) for s, i in ops), key=lambda o: key(o, True)))
        limit.append(min((p - 1 - r) * 2 + (v - 1) * p, m * v) + 1)
    return forwards, backwards, limit


def interleaved_1f1b(p: int, m: int, v: int = 2) -> Schedule:
    """Interleaved 1F1B: each rank holds v non-adjacent stages (rank r: r, r+p, ...), so a
    micro-batch crosses the ranks v times and the fill and drain take 1/v as long.

    Each rank takes its forwards in Megatron-LM's order: micro-batches in rounds of p, a round
    through the rank's first stage, then its second, ...; backwards the same with the stages
    reversed. It runs its next forward while fewer than Megatron's warm-up + 1 micro-batches
    are in flight, else its next backward, whichever is ready (played in time steps, so the
    order cannot deadlock). Constraints: v >= 2 (v = 1 is plain 1F1B), a model of at least
    p*v layers. Any m works; the bubble is (p-1)/(v*m+p-1) when p divides m, larger otherwise.
    """
    _check(p, m, v)
    if v < 2:
        raise MicroDDPError(f"interleaved 1F1B needs v >= 2 virtual stages per rank, got {v}; "
                            "with one stage per rank use the 1f1b schedule")

    forwards, backwards, limit = megatron_orders(p, m, v, "B")
    nf, nb = [0] * p, [0] * p

    def pick(r: int, ready: Callable[[Op], bool]) -> Op | None:
        if nf[r] < m * v and nf[r] - nb[r] < limit[r] and ready(forwards[r][nf[r]]):
            nf[r] += 1
            return forwards[r][nf[r] - 1]
        if nb[r] < nf[r] and ready(backwards[r][nb[r]]):
            nb[r] += 1
            return backwards[r][nb[r] - 1]
        return None

    return _with_comms("interleaved", p, m, v, _play(p, v, m, "B", pick))


def zero_bubble_h1(p: int, m: int) -> Schedule:
    """ZB-H1: backward split into I (gradient of the stage's input, which the previous stage
    is waiting for) and W (gradient of the weights, which nobody waits for).

    Played in time steps (F = I = W = 1): a free rank runs its next I if it can, else its next
    F if fewer than p-r micro-batches are between F and I (1F1B's memory bound), else its
    oldest pending W, so W fills the slots where 1F1B would sit idle.
    """
    _check(p, m)
    count = [{"F": 0, "I": 0, "W": 0} for _ in range(p)]

    def pick(r: int, ready: Callable[[Op], bool]) -> Op | None:
        c = count[r]
        candidates = []
        if c["I"] < c["F"]:
            candidates.append(("I", r, c["I"]))
        if c["F"] < m and c["F"] - c["I"] < p - r:
            candidates.append(("F", r, c["F"]))
        if c["W"] < c["I"]:
            candidates.append(("W", r, c["W"]))
        for op in candidates:
            if ready(op):
                c[op[0]] += 1
                return op
        return None

    return _with_comms("zero-bubble", p, m, 1, _play(p, 1, m, "I", pick))


BUILDERS: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b,
    "zero-bubble": zero_bubble_h1,
}


def build(name: str, p: int, m: int, v: int = 2) -> Schedule:
    """The schedule called `name` (gpipe, 1f1b, interleaved, zero-bubble) for p ranks and m
    micro-batches; `v` is the virtual stages per rank, used by interleaved only."""
    if name not in BUILDERS:
        raise MicroDDPError(f"unknown pipeline schedule {name!r}; choose one of "
                            f"{', '.join(BUILDERS)}")
    return interleaved_1f1b(p, m, v) if name == "interleaved" else BUILDERS[name](p, m)


def forward_only(schedule: Schedule) -> Schedule:
    """`schedule` without its backwards: each rank's forwards in the same order, for
    evaluation. Dropping the backwards removes no message a forward waits for, so the
    programs stay free of deadlock."""
    orders = [[(a.kind, a.stage, a.mb) for a in program if a.kind == "F"]
              for program in schedule.actions]
    return _with_comms(f"{schedule.name}-forward", schedule.ranks, schedule.microbatches,
                       schedule.virtual, orders, schedule.placement)
