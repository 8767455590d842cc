"""What a pipeline's messages cost on this host, measured by `predict --calibrate`.

Two sources, neither of which reads a benchmark's timeline:

- the relay: ranks 0 and 1 hand a message of each size back and forth, each running a stage's
  forward before it sends; one way = latency + bytes / bandwidth;
- the interpreter's own sends and receives, as `run_schedule(..., messages=...)` records them
  in the calibration's pipeline runs (`pipeline_costs`): a send's time on its sender's clock
  (the `isend` call and the runtime's bookkeeping); a receive's own time (its span less its
  wait for the data: posting the next receives the window allows, waiting for the sends its
  message proves done); and the **wake-up** of a receive that waits, from its message's due
  arrival (its send's end + latency + bytes / bandwidth) to the wait's end. gloo's threads
  and the woken rank wait for a core the computing ranks hold, and a receive posted after its
  send pays a round trip through both ranks' gloo threads inside its `irecv`: the relay,
  whose ranks block in every call, shows neither, so they are read where they happen.

A step pays every send, receive and wake-up, the ones a busy host delays included, so each is
charged its plain mean, per schedule and per width (`pipeline_costs` keeps them apart): on a
busy host the slow ones are not rare stalls but part of what a schedule's messages cost.
Interleaved's messages cross each other both ways at once, and about 1 in 30 of its sends
stalled for 2-5 ms (2 ranks pinned, 8 micro-batches: 1.7 such sends a step, none in 1F1B's),
so its median step holds one or two; a trimmed mean (10% cut at each end) dropped them and
the prediction of interleaved came out 20-43% low. A wake-up is likewise counted every time
(every receive that waits pays one: 1F1B waits in nearly every receive, GPipe in few).
Each schedule at each width gives hundreds of messages, so one stalled call among them moves
its mean by a few microseconds.

`time.perf_counter` is one clock for every process of a host (CLOCK_MONOTONIC), so a send's
end on one rank and its receipt on the other are compared directly, as the benchmark's
timelines are.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from .. import comms
from ..collectives.cost import fit_line
from ..comms.world import World
from ..launch.spawn import spawn
from ..model import FullMLP
from ..pipeline import placement
from ..pipeline.schedules import RECVS, SENDS, message_key
from ..timing import median

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


def mean_costs(sends: list[float], receives: list[float], wakes: list[float]) -> MessageCosts:
    """The sends', the receives' and the wake-ups' plain means (see the module's text), 0
    when there is none."""
    return MessageCosts(*(statistics.fmean(v) if v else 0.0 for v in (sends, receives, wakes)))
