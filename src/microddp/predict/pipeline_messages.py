"""What a pipeline's messages cost on this host, measured by `predict --calibrate` with two ranks.

Two jobs, neither of which reads a benchmark's timeline:

- the relay: ranks 0 and 1 hand a message of each size back and forth, each running a stage's
  forward before it sends; one way = latency + bytes / bandwidth, and the sender's hand-off
  (isend posted and completed, to a receiver already waiting);
- the pipeline's own pattern, which the relay does not have: the sender posts its `isend` and
  goes on computing without waiting for it (as `run_schedule` does), while the receiver has its
  receives posted ahead and blocks in one. Timed there: a blocked receive's wake-up (from the
  isend's post to the receiver's return, beyond the message's own latency + bytes / bandwidth:
  gloo's threads and the woken rank wait for a core the computing ranks hold, which the relay,
  whose sender blocks too, leaves free), and a receive's own cost on the receiver's clock when
  its message is already there (the wait, and posting the next receive, as the window does).

`time.perf_counter` is one clock for every process of a host (CLOCK_MONOTONIC), so a send's
post on one rank and its receipt on the other are compared directly, as the benchmark's
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

MESSAGE_BYTES = (2**12, 2**14, 2**16, 2**18)  # message sizes the relay sends
PATTERN_BYTES = 2**12  # the pattern's message: 8 rows of width 128, `bench pipeline`'s size
WINDOW = 2  # receives posted ahead, as `pipeline.runtime.WINDOW`


@dataclass(frozen=True)
class MessageCosts:
    """Seconds (bandwidth in bytes/s): see the module's text for what each one times."""

    latency: float
    bandwidth: float
    send: float
    receive: float
    wake: float

    def message(self, nbytes: float) -> float:
        """From a send's start to its data at the receiver."""
        return self.latency + nbytes / self.bandwidth


def _stage_work():
    """A stage's forward on a micro-batch, the work a pipeline rank does between messages."""
    stage, x = FullMLP(128, 4), torch.randn(8, 128)

    def work() -> None:
        with torch.no_grad():
            stage(x)

    for _ in range(5):
        work()  # warm-up
    return work


def _relay_job(world: World, repeats: int) -> list[tuple[int, float, float]]:
    """[(bytes, one way s beyond the compute, the sender's hand-off s)] per message size."""
    torch.set_num_threads(1)
    other, work = 1 - world.rank, _stage_work()
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


def _pattern_job(world: World, repeats: int) -> dict[str, list]:
    """Rank 0 sends as a pipeline rank does (posts its isend and computes on, waiting for a
    send only once its receiver surely has it), rank 1 receives as one does (its receives
    posted ahead, `WINDOW` of them), in two phases:

    - blocked: rank 0 computes three forwards between its sends, rank 1 one forward between
      its receives, so it waits in each;
    - ready: rank 0 sends once rank 1 has posted the receive (a barrier between them), and
      rank 1 sleeps before it waits, so the message is there by then.

    Returns per phase: rank 0's send posts; rank 1's (receive post, wait start, wait end, as
    the runtime's receive returns: the next receive posted)."""
    torch.set_num_threads(1)
    work = _stage_work()
    out: dict[str, list] = {}

    def irecv(i: int) -> tuple[float, object]:
        return time.perf_counter(), comms.irecv(torch.empty(PATTERN_BYTES // 4), src=0, tag=i)

    for phase in ("blocked", "ready"):
        rows: list = []
        comms.barrier()
        if world.rank == 0:
            pending = []
            for i in range(repeats):
                if phase == "blocked":
                    for _ in range(3):
                        work()
                else:
                    comms.barrier()  # rank 1 has posted this receive
                rows.append(time.perf_counter())
                pending.append(comms.isend(torch.randn(PATTERN_BYTES // 4), dst=1, tag=i))
                if len(pending) > WINDOW:
                    pending.pop(0).wait()  # the receiver has it by now, as the runtime knows
            for handle in pending:
                handle.wait()
        else:
            posted = [irecv(i) for i in range(WINDOW)]
            for i in range(repeats):
                if phase == "blocked":
                    work()
                else:
                    comms.barrier()
                    time.sleep(2e-3)  # the message is here by then
                post, handle = posted.pop(0)
                start = time.perf_counter()
                handle.wait()
                if i + WINDOW < repeats:
                    posted.append(irecv(i + WINDOW))  # the window moves on
                rows.append((post, start, time.perf_counter()))
        out[phase] = rows
        comms.barrier()
    return out


def wake_and_receive(sends: dict[str, list[float]], recvs: dict[str, list[tuple]],
                     message: float, skip: int = 2) -> tuple[float, float]:
    """(wake, receive) from the pattern job's times (per phase, rank 0's send posts and rank
    1's (receive post, wait start, wait end)), never below 0, the first `skip` messages of a
    phase left out as warm-up:

    - wake: the mean, over the blocked phase's receives posted before their send and waited
      for before the message was due (send post + `message`, latency + bytes / bandwidth), of
      how much later than due the wait returned. The mean, not the median: a step pays every
      wake-up, and on a host whose cores other processes hold a few of them take a
      scheduler's time slice (milliseconds) while most take tens of microseconds;
    - receive: the median, over the ready phase's receives posted before their send and
      waited for after it was due, of the wait and the posting of the next receive (its
      tail is the actions' tail, which `predict` applies to it)."""
    def median(values: list[float]) -> float:
        return max(statistics.median(values), 0.0) if values else 0.0

    def mean(values: list[float]) -> float:
        return max(statistics.mean(values), 0.0) if values else 0.0

    blocked = list(zip(sends["blocked"], recvs["blocked"], strict=True))[skip:]
    wake = [end - (sent + message) for sent, (post, start, end) in blocked
            if post < sent and start < sent + message]
    ready = list(zip(sends["ready"], recvs["ready"], strict=True))[skip:]
    receive = [end - start for sent, (post, start, end) in ready
               if post < sent and start >= sent + message]
    return mean(wake), median(receive)


def measure(repeats: int = 16) -> MessageCosts:
    """Run both jobs on two ranks and read them (see the module's text)."""
    trips = spawn(_relay_job, 2, args=(repeats,), timeout=300, backend="gloo")[0]
    latency, per_byte = fit_line([n for n, _, _ in trips], [t for _, t, _ in trips],
                                 nonnegative=True)
    bandwidth = 1 / per_byte if per_byte > 0 else float("inf")
    send = statistics.median(c for _, _, c in trips)
    sender, receiver = spawn(_pattern_job, 2, args=(repeats * 4,), timeout=300, backend="gloo")
    wake, receive = wake_and_receive(sender, receiver, latency + PATTERN_BYTES / bandwidth)
    return MessageCosts(latency, bandwidth, send, receive, wake)
