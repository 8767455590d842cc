"""What a pipeline's actions cost on this host, measured by `predict --calibrate`.

A stage's forward on a few rows is not its FLOPs at a whole model's rate: each Linear and ReLU
costs a call into torch whatever the rows, and each interpreter action adds its own (autograd,
posting receives, bookkeeping). So an action of k blocks on r rows of one width is fitted by
least squares as  fixed + k x (per_block + flops_per_block(r, width) / rate),  forward and
backward apart, per width (`fit_width`), or over all widths with a per-weight term
(`fit_actions`). The points come from the interpreter running GPipe and 1F1B on one rank per
core, each point the slowest rank's median; actions are stretched by `tail` (their trimmed mean
over their median: a step pays the slow ones too). The last stage's head, loss and
`loss.item()` are timed apart and charged to it alone; the step's fixed cost (zero_grad, the
optimizer) is fitted the same way. Nothing here reads a benchmark's timeline, so
`predict --compare` tests the model against a measurement it was not fitted on.
"""

from __future__ import annotations

import time
from dataclasses import astuple, dataclass, field

import torch

from .. import comms, pipeline
from ..collectives.cost import fit_line
from ..errors import MicroDDPError
from ..launch.spawn import spawn
from ..model import FullMLP
from ..timing import median, trimmed_mean
from ..world.world import World
from . import pipeline_messages as messages

BLOCKS = (2, 4, 8)  # blocks per stage the fit sees
ROWS = (4, 8, 16, 32)  # micro-batch rows the fit sees
DIMS = (128, 512)  # FullMLP widths the fit sees: overhead-bound and FLOP-bound actions


@dataclass(frozen=True)
class PipelineCosts:
    """Fitted costs, in seconds (rates in FLOP/s, bytes/s), for FullMLP stages, measured with
    `ranks` ranks at once on `cores` cores, one thread each."""

    forward_fixed: float
    forward_block: float
    forward_weight: float
    forward_rate: float
    backward_fixed: float
    backward_block: float
    backward_weight: float
    backward_rate: float
    step_fixed: float
    step_block: float
    last_forward: float
    last_backward: float
    tail: float
    latency: float
    bandwidth: float
    send: float
    receive: float
    wake: float
    ranks: int
    cores: int
    # per calibrated width (its str: a json key): [fixed, per_block, rate] fitted on that
    # width's points alone, used for a stage of that width instead of the fit over widths
    forward_widths: dict[str, list[float]] = field(default_factory=dict)
    backward_widths: dict[str, list[float]] = field(default_factory=dict)
    # {schedule: {calibrated width: [send, receive, wake]}}: what a message costs its ranks
    # in that schedule's own runs at that width (`pipeline_messages`), used instead of the
    # pooled send, receive and wake above for a job of that schedule and width
    schedule_messages: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    # {schedule: {calibrated width: [send, receive]}}: of those means, the part that is stalls
    # (mean less trimmed mean, `pipeline_messages.stall_costs`), which the step adds up
    schedule_stalls: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    def stalls(self, schedule: str, dim: int) -> tuple[float, float]:
        """(send, receive) stall per message of `schedule` at width `dim`, part of
        `messages`'s figures; (0, 0) where the calibration has none (an older one)."""
        own = self.schedule_stalls.get(schedule, {}).get(str(dim))
        return tuple(own) if own is not None else (0.0, 0.0)

    def messages(self, schedule: str, dim: int) -> tuple[float, float, float]:
        """(send, receive, wake) of a message of `schedule` between stages of width `dim`:
        that schedule's own at that width if calibrated, else the pooled figures."""
        own = self.schedule_messages.get(schedule, {}).get(str(dim))
        return tuple(own) if own is not None else (self.send, self.receive, self.wake)

    def forward(self, blocks: int, rows: float, dim: int) -> float:
        """One F action of a stage of `blocks` blocks of width `dim` on `rows` rows."""
        if str(dim) in self.forward_widths:
            fixed, per_block, rate = self.forward_widths[str(dim)]
            return fixed + blocks * (per_block + block_flops(dim, rows) / rate)
        return self.forward_fixed + blocks * (self.forward_block + dim * dim * self.forward_weight
                                              + block_flops(dim, rows) / self.forward_rate)

    def backward(self, blocks: int, rows: float, dim: int) -> float:
        """One B action (input and weight gradients) of the same stage."""
        if str(dim) in self.backward_widths:
            fixed, per_block, rate = self.backward_widths[str(dim)]
            return fixed + blocks * (per_block + 2 * block_flops(dim, rows) / rate)
        return self.backward_fixed + blocks * (self.backward_block
                                               + dim * dim * self.backward_weight
                                               + 2 * block_flops(dim, rows) / self.backward_rate)

    def head(self, kind: str) -> float:
        """What the last stage adds to an action of `kind`: its head and loss (F), their
        backward (B, and I and W, which each walk back from the loss)."""
        return self.last_forward if kind == "F" else self.last_backward

    def step(self, blocks: int) -> float:
        """A step's cost beside its actions, for a rank holding `blocks` blocks."""
        return self.step_fixed + self.step_block * blocks

    def message(self, nbytes: float) -> float:
        """From a send's start to its data at the receiver."""
        return self.latency + nbytes / self.bandwidth


def block_flops(dim: int, rows: float) -> float:
    """Forward FLOPs of one Linear(dim, dim) + ReLU block on `rows` rows (2 per weight)."""
    return 2 * (dim * dim + dim) * rows


def fit_actions(points: list[tuple[int, int, int, float]],
                flops_factor: float = 1.0) -> tuple[float, float, float, float]:
    """(fixed, per_block, per_weight, rate) of seconds = fixed + k (per_block + dim^2
    per_weight + factor flops(r, dim) / rate), least squares over (k, r, dim, seconds),
    relative error weighted as `fit_line` does (factor 2 for a backward: twice a forward's
    FLOPs). per_weight is what a block pays per weight whatever the rows (reading its matrix,
    writing its gradient): without it, a small matrix's product and a large one's would have
    to share one FLOP rate. A negative fitted term is set to zero and the rest refitted: no
    cost is negative."""
    if len({(k, r, d) for k, r, d, _ in points}) < 4 or len({k for k, *_ in points}) < 2 \
            or len({d for _, _, d, _ in points}) < 2:
        raise MicroDDPError("fitting action costs needs at least 4 (blocks, rows, width) "
                            "points with 2 different block counts and 2 widths")
    fixed, per_block, per_weight, per_flop = _nonnegative_fit(
        [[1.0, k, k * d * d, k * flops_factor * block_flops(d, r)] for k, r, d, _ in points],
        [s for *_, s in points])
    return fixed, per_block, per_weight, (1 / per_flop if per_flop > 0 else float("inf"))


def fit_width(points: list[tuple[int, int, int, float]],
              flops_factor: float = 1.0) -> list[float]:
    """[fixed, per_block, rate] of seconds = fixed + k (per_block + factor flops(r, dim) /
    rate) over one width's points, as `fit_actions` fits all widths at once: one width's
    per-weight cost is part of its per-block cost, so a width's own fit needs no assumption
    of how overheads and FLOPs scale from one width to another (with one FLOP rate and one
    per-weight cost for widths 128 and 512, the fit put a width-128 forward ~25% below the
    interpreter's)."""
    if len({(k, r) for k, r, _, _ in points}) < 3 or len({k for k, *_ in points}) < 2 \
            or len({d for _, _, d, _ in points}) != 1:
        raise MicroDDPError("fitting one width's action costs needs at least 3 (blocks, rows) "
                            "points of that one width with 2 different block counts")
    fixed, per_block, per_flop = _nonnegative_fit(
        [[1.0, k, k * flops_factor * block_flops(d, r)] for k, r, d, _ in points],
        [s for *_, s in points])
    return [fixed, per_block, 1 / per_flop if per_flop > 0 else float("inf")]


def _nonnegative_fit(features: list[list[float]], times: list[float]) -> list[float]:
    """Least squares of `times` on `features`, relative error; a negative coefficient is set
    to zero and the rest refitted, the most negative first."""
    a = torch.tensor(features, dtype=torch.float64)
    t = torch.tensor(times, dtype=torch.float64)
    keep = list(range(a.shape[1]))
    while True:
        w = (1 / t).unsqueeze(1)  # relative error: small actions count as much as large
        sol = torch.linalg.lstsq(a[:, keep] * w, (t * w.squeeze(1)).unsqueeze(1)).solution
        coef = dict(zip(keep, sol.squeeze(1).tolist(), strict=True))
        negative = [i for i, c in coef.items() if c < 0]
        if not negative or len(keep) == 1:
            break
        keep.remove(min(negative, key=lambda i: coef[i]))
    return [max(coef.get(i, 0.0), 0.0) for i in range(a.shape[1])]


def _head_times(dim: int, rows: int, microbatches: int, repeats: int) -> tuple[float, float]:
    """Median seconds that the last stage's own work adds to an F and to a B: a block with
    the head Linear to 2 classes, the loss scaled to the batch and `loss.item()`, then that
    loss's backward, less the same block alone and its backward from a given gradient (as a
    stage before the last runs them), so autograd's own start is not counted twice."""
    block, head = torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.ReLU()), \
        torch.nn.Linear(dim, 2)
    x, y, grad = torch.randn(rows, dim), torch.randint(0, 2, (rows,)), torch.randn(rows, dim)
    f, b = [], []
    for i in range(repeats * microbatches + 2):
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(head(block(x)), y) * (1 / microbatches)
        loss.item()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        out = block(x)
        t3 = time.perf_counter()
        torch.autograd.backward(out, grad)
        t4 = time.perf_counter()
        if i >= 2:  # warm-up
            f.append((t1 - t0) - (t3 - t2))
            b.append((t2 - t1) - (t4 - t3))
    return median(f), median(b)


MESSAGE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble")  # each one's messages


def _pipeline_job(world: World, microbatches: int, repeats: int) -> list[tuple]:
    """On every rank at once (the world is the pipeline: one stage of k blocks per rank, two
    of k / 2 for interleaved), run the interpreter's schedules, step by step in turn, for
    every (blocks k, rows r, width) and time them: [(k, r, dim, this rank's F spans, B spans,
    step minus its actions, {schedule: message records per step}, head F, head B)]; F and B
    spans and the step's rest from GPipe and 1F1B (one stage of k blocks: what the fit
    reads), messages from every schedule; the last rank's F and B include the head and loss,
    timed apart on every rank. Every schedule, because their messages differ: GPipe's ranks
    stream sends and seldom wait long, 1F1B's hand every micro-batch back and forth and wait
    in nearly every receive, interleaved's cross each other both ways at once."""
    torch.set_num_threads(1)  # as `bench pipeline` runs each rank
    pipeline.placement.pin(world.rank)  # as `bench pipeline` places them
    p, rank = world.world_size, world.rank
    schedules = {name: pipeline.build(name, p, microbatches) for name in MESSAGE_SCHEDULES}
    out = []
    for dim, k in ((d, k) for d in DIMS for k in BLOCKS):
        torch.manual_seed(0)
        held = {}  # schedule -> (its stages on this rank, their optimizer)
        for name, schedule in schedules.items():
            stages = pipeline.split_model(FullMLP(dim, k * p), schedule.stages)
            mine = {s: stages[s] for s in schedule.stages_of(rank)}
            held[name] = (mine, torch.optim.SGD([q for m in mine.values()
                                                 for q in m.parameters()], lr=1e-3))
        for r in ROWS:
            x = torch.randn(r * microbatches, dim)
            y = torch.randint(0, 2, (r * microbatches,))
            f, b, rest, steps = [], [], [], {name: [] for name in schedules}
            for i, name in ((i, n) for i in range(repeats + 2) for n in schedules):
                (mine, opt), record, messages = held[name], [], []
                comms.barrier()
                t0 = time.perf_counter()
                opt.zero_grad()
                pipeline.run_schedule(schedules[name], mine, x, y,
                                      torch.nn.functional.cross_entropy, record=record,
                                      messages=messages)
                opt.step()
                t1 = time.perf_counter()
                if i < 2:
                    continue  # warm-up
                steps[name].append(messages)
                if name not in ("gpipe", "1f1b"):
                    continue  # its stages differ: the fit reads one stage of k blocks
                f += [e - s for a, s, e in record if a.kind == "F"]
                b += [e - s for a, s, e in record if a.kind == "B"]
                spans = [(s, e) for _, s, e in record] + [(s, e) for _, s, e, *_ in messages]
                # before the first action and after the last: zero_grad, the optimizer, the
                # runtime's start and its end-of-step waits for sends
                rest.append((min(s for s, _ in spans) - t0) + (t1 - max(e for _, e in spans)))
            out.append((k, r, dim, f, b, median(rest), steps,
                        *_head_times(dim, r, microbatches, repeats)))
    return out


def measure(cores: int, microbatches: int = 4, repeats: int = 8) -> PipelineCosts:
    """Run the pipeline job on one rank per core (at least 2) and the relay on two, and fit
    them (see the module's text)."""
    ranks = max(cores, 2)
    per_rank = spawn(_pipeline_job, ranks, args=(microbatches, repeats), timeout=600,
                     backend="gloo")
    latency, bandwidth = messages.latency_and_bandwidth(repeats * 2)
    last = ranks - 1
    head_f = max(median(median(rank[i][7] for i in range(len(rank))) for rank in per_rank), 0.0)
    head_b = max(median(median(rank[i][8] for i in range(len(rank))) for rank in per_rank), 0.0)
    fwd_points, bwd_points, rest, tails = [], [], [], []
    read: dict[tuple[str, str], tuple[list, list, list]] = {}  # (schedule, width) -> records
    for i, (k, r, dim, *_) in enumerate(per_rank[0]):
        # the slowest rank's median: every rank ran the same work at once, but a pipeline
        # runs at its slowest stage's pace, and on a shared host one rank's core is slower
        # than another's (rank 0's forward 360 us against rank 1's 272 with the head, in one
        # run); the last rank's actions less the head and loss only it runs
        f = max(median(rank[i][3]) - (head_f if n == last else 0.0)
                for n, rank in enumerate(per_rank))
        b = max(median(rank[i][4]) - (head_b if n == last else 0.0)
                for n, rank in enumerate(per_rank))
        if f > 0:  # a point less than its head is noise: left out, not fitted as ~0
            fwd_points.append((k, r, dim, f))
        if b > 0:
            bwd_points.append((k, r, dim, b))
        both = [t for rank in per_rank for t in rank[i][3] + rank[i][4]]
        tails.append(trimmed_mean(both) / median(both))
        rest.append((k, median(rank[i][5] for rank in per_rank)))
        for name in MESSAGE_SCHEDULES:
            runs = per_rank[0][i][6][name]
            steps = [[rank[i][6][name][j] for rank in per_rank] for j in range(len(runs))]
            got = messages.read_messages(steps, latency, bandwidth, r * dim * 4)
            lists = read.setdefault((name, str(dim)), ([], [], []))
            for into, values in zip(lists, got, strict=True):
                into += values
    fwd, bwd = fit_actions(fwd_points), fit_actions(bwd_points, 2.0)
    fwd_widths = {str(d): fit_width([pt for pt in fwd_points if pt[2] == d]) for d in DIMS}
    bwd_widths = {str(d): fit_width([pt for pt in bwd_points if pt[2] == d], 2.0)
                  for d in DIMS}
    step_fixed, step_block = fit_line([k for k, _ in rest], [t for _, t in rest],
                                      nonnegative=True)
    pooled = messages.mean_costs(*([v for lists in read.values() for v in lists[n]]
                                   for n in range(3)))
    per_schedule: dict[str, dict[str, list[float]]] = {}
    stalls: dict[str, dict[str, list[float]]] = {}
    for (name, width), lists in read.items():
        per_schedule.setdefault(name, {})[width] = list(astuple(messages.mean_costs(*lists)))
        stalls.setdefault(name, {})[width] = list(messages.stall_costs(*lists[:2]))
    return PipelineCosts(*fwd, *bwd, step_fixed, step_block, head_f, head_b, median(tails),
                         latency, bandwidth, pooled.send, pooled.receive, pooled.wake, ranks,
                         cores, fwd_widths, bwd_widths, per_schedule, stalls)


def median_costs(rounds: list[PipelineCosts]) -> PipelineCosts:
    """Each figure's median over calibration rounds (a width's fit, a schedule's message
    costs: each of its terms')."""
    def med(values: list):
        if isinstance(values[0], dict):
            return {w: med([v[w] for v in values])
                    for w in values[0] if all(w in v for v in values)}
        if isinstance(values[0], list):
            return [median(v[i] for v in values) for i in range(len(values[0]))]
        return median(values)

    fields = PipelineCosts.__dataclass_fields__
    return PipelineCosts(**{name: (getattr(rounds[0], name) if name in ("ranks", "cores")
                                   else med([getattr(c, name) for c in rounds]))
                            for name in fields})
