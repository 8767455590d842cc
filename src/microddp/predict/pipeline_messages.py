"""What a pipeline's messages cost on this host, measured by `predict --calibrate`.

Two sources, neither a benchmark's timeline: a relay (two ranks hand each size back and
forth: latency + bytes / bandwidth), and the interpreter's own sends and receives in the
calibration's pipelines (`run_schedule(..., messages=...)`): a send's time, a receive's own
time, and the wake-up of a receive that waits, from its message's due arrival to the wait's
end (the woken rank waits for a core the computing ranks hold, which the relay never shows).

A slow call is not a slow copy of a typical one: now and then a rank's own gloo thread holds
its core for a scheduler tick, a stall of milliseconds the other ranks soon wait on. So each
mean is split (`stall_costs`): the trimmed mean (10% cut each end), which the schedule plays
on its rank's clock, and the rest, the stalls, which the step adds up over all messages.
`time.perf_counter` is one clock for every process of a host, so a send's end on one rank and
its receipt on another compare directly. Chapter 8 has the measurements.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from .. import comms
from ..collectives.cost import fit_line
from ..launch.spawn import spawn
from ..model import FullMLP
from ..pipeline import placement
from ..pipeline.schedules import RECVS, SENDS, Schedule, build, message_key
from ..timing import median, trimmed_mean
from ..world.world import World

MESSAGE_BYTES = (2**12, 2**14, 2**16, 2**18)  # message sizes the relay sends


@dataclass(frozen=True)
class MessageCosts:
    """Seconds, each a mean: see the module's text for what each one times."""

    send: float
    receive: float
    wake: float


def _stage_work():
    """A stage's forward on a micro-batch, the work a pipeline rank does between messages."""
    stage, x = FullMLP(128, 4), torch.randn(8, 128)

    def work() -> None:
        with torch.no_grad():
            stage(x)

    for _ in range(5):
        work()  # warm-up
    return work


def _relay_job(world: World, repeats: int) -> list[tuple[int, float]]:
    """[(bytes, one way s beyond the compute)] per message size."""
    torch.set_num_threads(1)
    placement.pin(world.rank)  # as `bench pipeline` places its ranks
    other, work = 1 - world.rank, _stage_work()
    out = []
    for nbytes in MESSAGE_BYTES:
        buf, got = torch.randn(nbytes // 4), torch.empty(nbytes // 4)
        hops = []
        for i in range(repeats + 2):
            comms.barrier()
            t0 = time.perf_counter()
            if world.rank == 1:
                comms.irecv(got, src=other, tag=i).wait()
            c0 = time.perf_counter()
            work()
            c1 = time.perf_counter()
            comms.isend(buf, dst=other, tag=i).wait()
            if world.rank == 0:
                comms.irecv(got, src=other, tag=i).wait()
                if i >= 2:  # two hops, each after a compute (the peer's about as long)
                    hops.append((time.perf_counter() - t0 - 2 * (c1 - c0)) / 2)
        out.append((buf.nbytes, max(median(hops), 1e-7) if hops else 0.0))
    return out


def latency_and_bandwidth(repeats: int = 16) -> tuple[float, float]:
    """(seconds, bytes/s) of one message one way, fitted over the relay's sizes, on two ranks."""
    trips = spawn(_relay_job, 2, args=(repeats,), timeout=300, backend="gloo")[0]
    latency, per_byte = fit_line([n for n, _ in trips], [t for _, t in trips],
                                 nonnegative=True)
    return latency, (1 / per_byte if per_byte > 0 else float("inf"))


def read_messages(steps: list[list[list[tuple]]], latency: float, bandwidth: float,
                  nbytes: float) -> tuple[list[float], list[float], list[float]]:
    """(send times, receive own times, wake-ups) of one configuration's steps, each step the
    ranks' message records (action, start, end, wait start, wait end), as `run_schedule`
    writes them; every message `nbytes` long, due latency + nbytes / bandwidth after its
    send's end.

    A receive's own time is its span less its wait; a wait that began before the message was
    due is a wake-up from the due time to its end (never below 0); one that began after it is
    the message running late, and counts as the receive's own time."""
    sends, receives, wakes = [], [], []
    transfer = latency + nbytes / bandwidth
    for ranks in steps:
        sent = {message_key(a): end for records in ranks for a, _, end, *_ in records
                if a.kind in SENDS}
        for records in ranks:
            for a, start, end, wait_start, wait_end in records:
                if a.kind in SENDS:
                    sends.append(end - start)
                elif a.kind in RECVS:
                    due = sent[message_key(a)] + transfer
                    own = (end - start) - (wait_end - wait_start)
                    if wait_start < due:
                        wakes.append(max(wait_end - due, 0.0))
                    else:
                        own += wait_end - wait_start
                    receives.append(own)
    return sends, receives, wakes


def both_ways(schedule: Schedule) -> bool:
    """Whether two ranks of `schedule` send each other activations, so that messages cross on
    one connection both ways: interleaving on 2 ranks (stage 0 -> 1 goes from rank 0 to 1,
    stage 1 -> 2 from rank 1 to 0). On p >= 3 ranks every connection carries activations one
    way and gradients the other, as GPipe's and 1F1B's do."""
    ways = {(a.rank, schedule.peer(a)) for program in schedule.actions for a in program
            if a.kind == "SEND_ACT"}
    return any((b, a) in ways for a, b in ways)


def costs_from(name: str, schedule: Schedule, calibrated_ranks: int) -> str:
    """The calibrated schedule whose message costs `schedule` (called `name`) pays: its own,
    unless its calibration run crossed messages both ways and the job's does not (interleaved
    calibrated on 2 ranks, run on more): then 1F1B's, the schedule whose steady state it runs
    per virtual stage over connections like its own. Stalls come mostly from messages
    crossing both ways (see the module's text): on 4 ranks interleaved's own gloo thread spun
    in 0.4% of its calls, against 2% on 2 ranks, so the 2-rank figures would charge stalls
    that do not happen."""
    calibrated = build(name, calibrated_ranks, schedule.microbatches, schedule.virtual)
    return "1f1b" if both_ways(calibrated) and not both_ways(schedule) else name


def stall_costs(sends: list[float], receives: list[float]) -> tuple[float, float]:
    """(send, receive) stall per message: each plain mean less its trimmed mean (see the
    module's text), 0 when there is none; never negative."""
    return tuple(max(statistics.fmean(v) - trimmed_mean(v), 0.0) if v else 0.0
                 for v in (sends, receives))


def mean_costs(sends: list[float], receives: list[float], wakes: list[float]) -> MessageCosts:
    """The sends', the receives' and the wake-ups' plain means (see the module's text), 0
    when there is none."""
    return MessageCosts(*(statistics.fmean(v) if v else 0.0 for v in (sends, receives, wakes)))
