"""Predict a pipeline step: the schedule played with each action's cost and each message's.

The schedule's own programs are played (`microddp.pipeline.simulate`) with costs per action
and per message, so the bubble and the step time come out of the plan the interpreter runs,
not out of a formula: interleaving's extra messages and zero-bubble's filled slots are counted
as they happen.

With a calibration of this host (`predict --calibrate`: pipeline_costs.py, pipeline_messages.py)
an action costs what the interpreter measured running a pipeline of its own, a message its
latency plus its bytes at the measured bandwidth, with the send's, the receive's and a waiting
receive's wake-up cost as measured; with more ranks than cores, compute stretches by the ranks
that share a core. Without one (a preset), a forward costs its FLOPs (2 per weight per sample)
at the rank's rate, a backward twice that, and a message alpha + bytes x beta. Chapter 8 and
docs/guides/pipeline.md show the model against measurements.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import pipeline
from ..errors import MicroDDPError
from ..pipeline import Action
from ..pipeline.schedules import SENDS
from .pipeline_costs import PipelineCosts, block_flops
from .pipeline_messages import costs_from
from .step import Hardware


@dataclass(frozen=True)
class PipelineJob:
    """What `microddp bench pipeline` runs: p ranks, m micro-batches, a FullMLP, the batch."""

    stages: int
    microbatches: int
    dim: int
    depth: int
    batch: int
    virtual: int = 2
    sleep_ms: float | None = None  # per block forward, as --compute sleep adds


def rank_rate(hw: Hardware, ranks: int) -> float:
    """FLOP/s one rank gets: the host's rate shared by the ranks running at once (CPU ranks
    beyond the cores time-share them), but no more than one rank alone reaches."""
    sharing = min(ranks, hw.cores) if hw.cores else 1
    rate = hw.flops / sharing
    return min(rate, hw.rank_flops) if hw.rank_flops else rate


def predict(job: PipelineJob, name: str, hw: Hardware,
            costs: PipelineCosts | None = None) -> dict:
    """One step of schedule `name` for `job` on `hw`: bubble, step and transfer time (s).
    `costs`: this host's calibrated action and message costs (then `hw` is not used)."""
    schedule = pipeline.build(name, job.stages, job.microbatches, job.virtual)
    blocks = pipeline.blocks_per_stage(job.depth, schedule.stages)
    pipeline.microbatch_sizes(job.batch, job.microbatches)  # raises, saying what to do
    mb = job.batch / job.microbatches  # the mean micro-batch: sizes differ by one at most
    sleep = (job.sleep_ms or 0.0) / 1e3
    message = mb * job.dim * 4
    # every message is one send and one receive (the validator matches them)
    sends = sum(a.kind in SENDS for prog in schedule.actions for a in prog)
    cost = (_calibrated_cost(job, blocks, costs, mb, sleep) if costs is not None
            else _flops_cost(job, blocks, hw, mb, sleep))
    cores = idle = None
    if costs is not None:
        # a send's and a receive's typical time run on their rank's clock as compute does;
        # the transfer and the wake-up are waits
        transfer = costs.message(message)
        # interleaved on 4 ranks pays 1F1B's: the calibration's 2 ranks cross messages both
        # ways, the job's do not (`pipeline_messages.costs_from`)
        paid = costs_from(name, schedule, costs.ranks)
        send, receive, wake = costs.messages(paid, job.dim)
        # the stalls among them (gloo's thread spinning on its rank's core) hold one rank for
        # milliseconds and the others soon wait on it: the step pays all ranks' stalls in
        # turn, after the play of the typical calls (`pipeline_messages`)
        send_stall, receive_stall = costs.stalls(paid, job.dim)
        send, receive = send - send_stall, receive - receive_stall
        stalled = sends * (send_stall + receive_stall)
        # every rank runs zero_grad and the optimizer at once: p ranks share the cores
        fixed = max(costs.step(sum(blocks[s] for s in schedule.stages_of(r)))
                    for r in range(job.stages)) * max(1.0, job.stages / costs.cores)
        # with more ranks than cores, the ranks pinned to one core share it while they
        # compute (a sleep holds no core)
        cores = costs.cores

        def idle(a: Action) -> float:
            return SHARE[a.kind] * blocks[a.stage] * sleep
    else:
        transfer, send, fixed = hw.latency + message / hw.bandwidth, 0.0, 0.0
        receive = wake = stalled = 0.0
    timeline = pipeline.simulate(schedule, cost, transfer, send, receive, wake, cores, idle)
    ideal = pipeline.simulate(schedule, cost, cores=cores, idle=idle)
    return {"schedule": name, "bubble": timeline.bubble,
            "step_s": timeline.makespan + fixed + stalled,
            "step_without_transfer_s": ideal.makespan + fixed,
            "transfer_per_message_s": transfer,
            "messages": sends, "bytes_sent": sends * message,
            "bubble_theory": pipeline.theory_bubble(schedule)}


SHARE = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}  # of a forward's FLOPs and sleeps


def _flops_cost(job: PipelineJob, blocks: list[int], hw: Hardware, mb: float, sleep: float):
    """An action's cost from FLOPs alone, at a preset's rate (no per-operation overhead)."""
    rate = rank_rate(hw, job.stages)
    per_block = block_flops(job.dim, mb)
    head_flops = 2 * (job.dim * 2 + 2) * mb  # the last stage's Linear to 2 classes
    last = len(blocks) - 1

    def cost(a: Action) -> float:
        flops = blocks[a.stage] * per_block + (head_flops if a.stage == last else 0)
        return SHARE[a.kind] * (flops / rate + blocks[a.stage] * sleep)

    return cost


def _calibrated_cost(job: PipelineJob, blocks: list[int], costs: PipelineCosts, mb: float,
                     sleep: float):
    """An action's cost as the calibration measured the interpreter's: F and B fitted; I
    computes the input's gradient only (one of a backward's two products per Linear: half a
    B), and none on stage 0, whose input needs none; W walks the whole backward again for the
    weights (`runtime`'s simple split: a B); `sleep` per block forward on top (twice
    backward)."""
    last = len(blocks) - 1

    def cost(a: Action) -> float:
        k = blocks[a.stage]
        compute = {"F": costs.forward(k, mb, job.dim), "B": costs.backward(k, mb, job.dim),
                   "I": costs.backward(k, mb, job.dim) / 2 if a.stage > 0 else 0.0,
                   "W": costs.backward(k, mb, job.dim)}[a.kind]
        if a.stage == last:  # the head, the loss and loss.item() run on the last stage only
            compute += costs.head(a.kind)
        return compute * costs.tail + SHARE[a.kind] * k * sleep

    return cost


def from_bench(result: dict) -> PipelineJob:
    """The job a pipeline.json of `microddp bench pipeline` describes."""
    try:
        c = result["config"]
        return PipelineJob(c["stages"], c["microbatches"], c["dim"], c["depth"], c["batch"],
                           c["virtual"], c["sleep_ms"] if c["compute"] == "sleep" else None)
    except (KeyError, TypeError) as e:
        raise MicroDDPError(f"not a pipeline.json of `microddp bench pipeline` (no {e} in its "
                            "config); run the benchmark and pass its pipeline.json") from None


def table(job: PipelineJob, rows: list[dict], measured: dict | None = None) -> str:
    """Predicted bubbles and step times, and beside them the benchmark's, if given."""
    head = (f"{'schedule':12}{'bubble':>8}{'theory':>8}{'step ms':>10}{'of it transfer':>16}"
            f"{'bytes sent':>12}")
    if measured is not None:
        head += f"{'measured bubble':>17}{'step ms':>10}{'error':>8}"
    lines = [head]
    for r in rows:
        line = (f"{r['schedule']:12}{r['bubble']:>8.3f}{r['bubble_theory']:>8.3f}"
                f"{1e3 * r['step_s']:>10.2f}"
                f"{1e3 * (r['step_s'] - r['step_without_transfer_s']):>16.2f}"
                f"{r['bytes_sent']:>12.3g}")
        if measured is not None and r["schedule"] in measured:
            got = measured[r["schedule"]]
            err = (1e3 * r["step_s"] - got["step_ms"]) / got["step_ms"]
            line += f"{got['bubble_measured']:>17.3f}{got['step_ms']:>10.2f}{100 * err:>7.0f}%"
        lines.append(line)
    if measured is not None and not measured.get("config", {}).get("pinned", False):
        lines.append("note: the benchmark's ranks were not pinned (--no-pin, or a benchmark "
                     "older than pinning); the calibration's are and the model assumes so "
                     "(microddp.pipeline.placement): a send that wakes a waiting rank cost "
                     "0.5-2 ms more unpinned here")
    return "\n".join(lines)


def _stage_costs(job: PipelineJob, costs: PipelineCosts, mb: float) -> str:
    """F and B of each stage size the job's schedules cut (p stages; p x v interleaved)."""
    cuts = [job.stages] + ([job.stages * job.virtual] if job.virtual > 1
                           and job.depth >= job.stages * job.virtual else [])
    sizes = sorted({k for n in cuts for k in pipeline.blocks_per_stage(job.depth, n)},
                   reverse=True)
    return ", ".join(f"F {1e3 * costs.forward(k, mb, job.dim):.3f} ms, B "
                     f"{1e3 * costs.backward(k, mb, job.dim):.3f} ms for {k} blocks"
                     for k in sizes)


def _message_costs(job: PipelineJob, costs: PipelineCosts) -> str:
    """Each schedule's (send, receive, wake-up) in us at the job's width, the pooled ones
    where the calibration did not run that schedule at that width."""
    own = [n for n in pipeline.BUILDERS if str(job.dim) in costs.schedule_messages.get(n, {})]
    rows = [(n, costs.messages(n, job.dim)) for n in own] if own else \
        [("every schedule", (costs.send, costs.receive, costs.wake))]

    def stall(x: float) -> str:
        return f" ({1e6 * x:.0f} stalls)" if x else ""

    def row(n: str, s: float, r: float, w: float) -> str:
        ss, rs = costs.stalls(n, job.dim)  # (0, 0) for the pooled row: it names no schedule
        return f"{n} {1e6 * s:.0f}{stall(ss)}, {1e6 * r:.0f}{stall(rs)}, +{1e6 * w:.0f} us"

    return "; ".join(row(n, *figures) for n, figures in rows)


def _paid(job: PipelineJob, costs: PipelineCosts) -> str:
    """Which schedules pay another's message costs in this job (`costs_from`), said."""
    other = [(n, costs_from(n, pipeline.build(n, job.stages, job.microbatches, job.virtual),
                            costs.ranks)) for n in pipeline.BUILDERS
             if n != "interleaved" or job.virtual >= 2]  # v = 1: no interleaved schedule
    return "".join(f"; {n} pays {paid}'s here (its connections carry messages one way, as "
                   f"{paid}'s do)" for n, paid in other if paid != n)


def describe(job: PipelineJob, hw: Hardware, costs: PipelineCosts | None = None) -> str:
    """One line naming the job and the hardware the prediction assumes."""
    if costs is not None:
        mb = job.batch / job.microbatches
        sleep = f"{job.sleep_ms:g} ms sleep per block forward + " if job.sleep_ms else ""
        return (f"pipeline: {job.stages} ranks, {job.microbatches} micro-batches, FullMLP("
                f"{job.dim}, depth {job.depth}), batch {job.batch}; compute: {sleep}this "
                f"host's calibrated actions, {mb:g} rows: {_stage_costs(job, costs, mb)} "
                f"(x {costs.tail:.2f}, their trimmed mean over their median); "
                f"last stage + {1e3 * costs.last_forward:.3f} ms F, "
                f"+ {1e3 * costs.last_backward:.3f} ms B (head, loss); step + "
                f"{1e3 * costs.step(max(pipeline.blocks_per_stage(job.depth, job.stages))):.3f}"
                f" ms; messages: {1e6 * costs.latency:.0f} us + bytes / {costs.bandwidth:.3g} "
                f"B/s; a send, a receive (of them, stalls: added up over the step), + a "
                f"wake-up where a receive waits: "
                f"{_message_costs(job, costs)} "
                f"(calibrated with {costs.ranks} ranks on {costs.cores} cores){_paid(job, costs)}")
    compute = (f"{job.sleep_ms:g} ms sleep per block forward + FLOPs at {rank_rate(hw, job.stages):.3g} "
               "FLOP/s per rank" if job.sleep_ms else
               f"FLOPs at {rank_rate(hw, job.stages):.3g} FLOP/s per rank")
    return (f"pipeline: {job.stages} ranks, {job.microbatches} micro-batches, FullMLP({job.dim}, "
            f"depth {job.depth}), batch {job.batch}; compute: {compute}; messages: "
            f"{1e6 * hw.latency:.0f} us + bytes / {hw.bandwidth:.3g} B/s ({hw.note})")
