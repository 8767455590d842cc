"""What a pipeline's actions and messages cost on this host, measured by `predict --calibrate`.

A FullMLP stage's forward on a micro-batch of a few rows is not its FLOPs at a whole model's
rate: each Linear and ReLU is a call into torch that costs its overhead whatever the rows, and
each action of the interpreter (`run_schedule`) adds its own (autograd's graph, the loss on the
last stage, the bookkeeping). So an action of a stage of k blocks on r rows is fitted as

    seconds = fixed + k x (per_block + flops_per_block(r, width) / rate)

separately for forward and backward, by least squares over several k, r and widths. The points come
from the interpreter itself running a one-stage schedule (`gpipe` with p = 1: no messages) on
one rank per core at once, each with one thread, as `microddp bench pipeline` runs its ranks:
its own recorded F and B spans. The step's fixed cost (zero_grad, the optimizer, the start and
end of `run_schedule`) is the rest of the measured step, fitted as fixed + per_block x k.
Messages are timed apart, by a relay of `comms.isend`/`irecv` between two ranks that each
run a stage's forward before handing the message on (busy processes woken by a message, as
pipeline ranks are: on a loaded host the wake-up, not the copy, is most of a message's cost),
at several sizes: one way = latency + bytes / bandwidth, and the sender's hand-off: from
posting the `isend` to its completion, to a receiver already waiting (what the sender's clock
pays for a message; the interpreter itself never waits at a send, but the hand-off takes the
sender's process all the same).

Nothing here reads a benchmark's timeline: the figures come from these runs alone, so
`predict --compare` tests the model against a measurement it was not fitted on.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from .. import comms, pipeline
from ..collectives.cost import fit_line
from ..comms.world import World
from ..errors import MicroDDPError
from ..launch.spawn import spawn
from ..model import FullMLP

BLOCKS = (2, 4, 8)  # blocks per stage the fit sees
ROWS = (4, 8, 16, 32)  # micro-batch rows the fit sees
DIMS = (128, 512)  # FullMLP widths the fit sees: overhead-bound and FLOP-bound actions
MESSAGE_BYTES = (2**12, 2**14, 2**16, 2**18)  # message sizes the ping-pong sends


@dataclass(frozen=True)
class PipelineCosts:
    """Fitted costs, in seconds (rates in FLOP/s, bytes/s), for FullMLP stages, measured with
    `ranks` ranks at once on `cores` cores, one thread each."""

    forward_fixed: float
    forward_block: float
    forward_rate: float
    backward_fixed: float
    backward_block: float
    backward_rate: float
    step_fixed: float
    step_block: float
    latency: float
    bandwidth: float
    send: float
    ranks: int
    cores: int

    def forward(self, blocks: int, rows: float, dim: int) -> float:
        """One F action of a stage of `blocks` blocks of width `dim` on `rows` rows."""
        return self.forward_fixed + blocks * (self.forward_block
                                              + block_flops(dim, rows) / self.forward_rate)

    def backward(self, blocks: int, rows: float, dim: int) -> float:
        """One B action (input and weight gradients) of the same stage."""
        return self.backward_fixed + blocks * (self.backward_block
                                               + 2 * block_flops(dim, rows) / self.backward_rate)

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
                flops_factor: float = 1.0) -> tuple[float, float, float]:
    """(fixed, per_block, rate) of seconds = fixed + k (per_block + factor flops(r, dim) /
    rate), least squares over (k, r, dim, seconds), relative error weighted as `fit_line` does (factor 2
    for a backward: twice a forward's FLOPs). A negative fitted
    term is set to zero and the rest refitted: no cost is negative."""
    if len({(k, r, d) for k, r, d, _ in points}) < 3 or len({k for k, *_ in points}) < 2:
        raise MicroDDPError("fitting action costs needs at least 3 (blocks, rows, width) "
                            "points with 2 different block counts")
    features = [[1.0, k, k * flops_factor * block_flops(d, r)] for k, r, d, _ in points]
    a = torch.tensor(features, dtype=torch.float64)
    t = torch.tensor([s for *_, s in points], dtype=torch.float64)
    keep = [0, 1, 2]
    while True:
        w = (1 / t).unsqueeze(1)  # relative error: small actions count as much as large
        sol = torch.linalg.lstsq(a[:, keep] * w, (t * w.squeeze(1)).unsqueeze(1)).solution
        coef = dict(zip(keep, sol.squeeze(1).tolist(), strict=True))
        negative = [i for i, c in coef.items() if c < 0]
        if not negative or len(keep) == 1:
            break
        keep.remove(negative[0])
    fixed, per_block, per_flop = (max(coef.get(i, 0.0), 0.0) for i in range(3))
    return fixed, per_block, (1 / per_flop if per_flop > 0 else float("inf"))


def _stage_job(world: World, microbatches: int, repeats: int) -> list[tuple]:
    """On this rank alone (its own group of one), time the interpreter's F, B and whole step
    for every (blocks, rows, width): [(k, r, dim, median F, median B, median step minus its
    actions)]."""
    torch.set_num_threads(1)  # as `bench pipeline` runs each rank
    groups = [comms.new_group([r]) for r in range(world.world_size)]
    mine = groups[world.rank]
    schedule = pipeline.build("gpipe", 1, microbatches)
    out = []
    for dim, k in ((d, k) for d in DIMS for k in BLOCKS):
        torch.manual_seed(0)
        stage = FullMLP(dim, k)
        opt = torch.optim.SGD(stage.parameters(), lr=1e-3)
        for r in ROWS:
            x = torch.randn(r * microbatches, dim)
            y = torch.randint(0, 2, (r * microbatches,))
            f, b, rest = [], [], []
            for i in range(repeats + 2):
                record: list = []
                t0 = time.perf_counter()
                opt.zero_grad()
                pipeline.run_schedule(schedule, {0: stage}, x, y,
                                      torch.nn.functional.cross_entropy, group=mine,
                                      record=record)
                opt.step()
                wall = time.perf_counter() - t0
                if i < 2:
                    continue  # warm-up
                f += [e - s for a, s, e in record if a.kind == "F"]
                b += [e - s for a, s, e in record if a.kind == "B"]
                rest.append(wall - sum(e - s for _, s, e in record))
            out.append((k, r, dim, statistics.median(f), statistics.median(b),
                        statistics.median(rest)))
    return out


def _relay_job(world: World, repeats: int) -> list[tuple[int, float, float]]:
    """Ranks 0 and 1 hand a message of each size back and forth, each running a stage's
    forward before it sends (as a pipeline rank does: a busy process that blocks in a receive
    and is woken by the message, which on a loaded host is what a message costs):
    [(bytes, one way s beyond the compute, the sender's hand-off s: isend posted and
    completed, to a receiver already waiting)]."""
    torch.set_num_threads(1)
    other = 1 - world.rank
    stage, x = FullMLP(128, 4), torch.randn(8, 128)

    def work() -> None:
        with torch.no_grad():
            stage(x)

    for _ in range(5):
        work()  # warm-up
    out = []
    for nbytes in MESSAGE_BYTES:
        buf, got = torch.randn(nbytes // 4), torch.empty(nbytes // 4)
        hops, calls = [], []
        for i in range(repeats + 2):
            comms.barrier()
            t0 = time.perf_counter()
            if world.rank == 1:
                comms.irecv(got, src=other, tag=i).wait()
            c0 = time.perf_counter()
            work()
            c1 = time.perf_counter()
            comms.isend(buf, dst=other, tag=i).wait()
            calls.append(time.perf_counter() - c1)
            if world.rank == 0:
                comms.irecv(got, src=other, tag=i).wait()
                if i >= 2:  # two hops, each after a compute (the peer's about as long)
                    hops.append((time.perf_counter() - t0 - 2 * (c1 - c0)) / 2)
        out.append((buf.nbytes, max(statistics.median(hops), 1e-7) if hops else 0.0,
                    statistics.median(calls[2:])))
    return out


def measure(cores: int, microbatches: int = 4, repeats: int = 8) -> PipelineCosts:
    """Run the stage and ping-pong jobs on this host and fit them (see the module's text)."""
    ranks = max(cores, 1)
    per_rank = spawn(_stage_job, ranks, args=(microbatches, repeats), timeout=600,
                     backend="gloo")
    # the median over ranks of each point: every rank ran the same work at the same time
    points = [tuple(statistics.median(rank[i][j] for rank in per_rank) for j in range(6))
              for i in range(len(per_rank[0]))]
    fwd = fit_actions([(k, r, d, f) for k, r, d, f, _, _ in points])
    bwd = fit_actions([(k, r, d, b) for k, r, d, _, b, _ in points], 2.0)
    step_fixed, step_block = fit_line([k for k, *_ in points], [s for *_, s in points],
                                      nonnegative=True)
    trips = spawn(_relay_job, 2, args=(repeats * 2,), timeout=300, backend="gloo")[0]
    latency, per_byte = fit_line([n for n, _, _ in trips], [t for _, t, _ in trips],
                                 nonnegative=True)
    return PipelineCosts(*fwd, *bwd, step_fixed, step_block, latency,
                         1 / per_byte if per_byte > 0 else float("inf"),
                         statistics.median(c for _, _, c in trips), ranks, cores)


def median_costs(rounds: list[PipelineCosts]) -> PipelineCosts:
    """Each figure's median over calibration rounds."""
    fields = PipelineCosts.__dataclass_fields__
    return PipelineCosts(**{name: statistics.median(getattr(c, name) for c in rounds)
                            if name not in ("ranks", "cores") else getattr(rounds[0], name)
                            for name in fields})
