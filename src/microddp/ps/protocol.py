"""The messages between the servers and their workers, and how they move: point-to-point only.

Every message is one frame (flat.py): an int64 header, then a flat float32 body, sent and
received as one buffer. Header: [kind, sender, version, clock, samples]: the version is the
parameter version the body was computed from (gradients) or is (parameters); clock is the
global batch the worker computes next (parameters: the server owns every worker's place in the
data, so a resumed server puts its workers back where they were) or computed (gradients). A
gradient's body ends with one more number, the shard's summed loss, for the progress lines.
The size of a message is fixed per direction and shard, so STOP and BYE travel in the same
frame as parameters and gradients; their bodies are not read.

A server listens to each worker on a thread of its own (`Inbox`): gloo's receive work does
not report completion until waited on, so polling several receives from one thread cannot
work; a blocking receive per worker can, and a worker that dies ends its thread's receive at
once with gloo's "connection closed", which the thread turns into a LOST message.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch import nn

from .. import comms
from ..errors import MicroDDPError
from .flat import Frame, frame

PARAMS, STOP, GRAD, BYE, LOST = range(5)
TAG_FRAME = 3  # not the 1 and 2 of the header and payload messages this protocol once sent
TAG_SHARD = 4  # a server's shard to server 0 between updates, apart from the workers' traffic


def flat_params(model: nn.Module) -> torch.Tensor:
    """All parameters in one float32 tensor, in model.parameters() order."""
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


@torch.no_grad()
def load_flat(model: nn.Module, flat: torch.Tensor) -> None:
    """Copy a flat tensor back into the parameters."""
    offset = 0
    for p in model.parameters():
        p.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


def send(f: Frame, dst: int, kind: int, sender: int, version: int = 0, clock: int = 0,
         samples: int = 0, timeout: float | None = None) -> None:
    """Write the header into frame `f` and send the frame to `dst` (returns once `f` may be
    reused: a server sends one frame to each worker in turn). With `timeout`, a receiver that
    has not posted its receive within that many seconds (a frozen worker) raises
    MicroDDPError; the send left waiting holds a copy of the frame, so `f` is free again."""
    f.head.copy_(torch.tensor([kind, sender, version, clock, samples], dtype=torch.int64))
    if timeout is None:
        comms.send(f.buf, dst, tag=TAG_FRAME)
        return
    comms.isend(f.buf.clone(), dst, tag=TAG_FRAME).wait(timedelta(seconds=timeout))


def recv(f: Frame, src: int, timeout: float) -> tuple[int, int, int, int, int]:
    """One message from `src` into frame `f`; its header as (kind, sender, version, clock,
    samples). Raises RuntimeError (gloo's) if `src` is gone or silent for `timeout` s."""
    comms.irecv(f.buf, src, tag=TAG_FRAME).wait(timedelta(seconds=timeout))
    kind, sender, version, clock, samples = f.head.tolist()
    return kind, sender, version, clock, samples


def push_shard(f: Frame, dst: int):
    """Start sending a copy of frame `f` to server `dst` on the shard tag (the frame itself
    goes on changing); wait on the handle before the next."""
    return comms.isend(f.buf.clone(), dst, tag=TAG_SHARD)


def pull_shard(f: Frame, src: int, timeout: float) -> None:
    """Receive server `src`'s shard, sent with push_shard, into frame `f`."""
    comms.irecv(f.buf, src, tag=TAG_SHARD).wait(timedelta(seconds=timeout))


@dataclass
class Message:
    """One message between a worker and the server, decoded from its header and payload."""
    kind: int
    worker: int
    version: int = 0
    clock: int = 0
    samples: int = 0
    payload: torch.Tensor | None = None  # a gradient, without its loss
    loss: float = 0.0  # a gradient's shard loss, summed over its samples
    error: str = ""


class Inbox:
    """Everything the workers send to the server, in arrival order, from one thread per worker.

    A thread ends after its worker's BYE or when its receive fails (LOST). `timeout` is only a
    backstop for a receive that never ends; the server decides when a silent worker is lost.
    """

    def __init__(self, workers: list[int], numel: int, timeout: float) -> None:
        self.messages: queue.Queue[Message] = queue.Queue()
        self.threads = [threading.Thread(target=self._listen, args=(w, numel, timeout),
                                         name=f"microddp-ps-inbox-{w}", daemon=True)
                        for w in workers]
        for t in self.threads:
            t.start()

    def _listen(self, worker: int, numel: int, timeout: float) -> None:
        while True:
            f = frame(numel + 1)  # a new one each time: the server holds gradients a while
            try:
                kind, sender, version, clock, samples = recv(f, worker, timeout)
            except RuntimeError as e:  # gloo: connection closed by the peer, or timed out
                self.messages.put(Message(LOST, worker, error=str(e).splitlines()[0][:200]))
                return
            if sender != worker or kind not in (GRAD, BYE):
                self.messages.put(Message(LOST, worker, error=f"unexpected header "
                                          f"{f.head.tolist()}: not a microddp.ps worker?"))
                return
            loss = float(f.body[numel]) if kind == GRAD else 0.0
            self.messages.put(Message(kind, worker, version, clock, samples, f.body[:numel],
                                      loss))
            if kind == BYE:
                return

    def get(self, timeout: float) -> Message | None:
        """The next message, or None if none came within `timeout` seconds."""
        try:
            return self.messages.get(timeout=timeout)
        except queue.Empty:
            return None


def server_gone(rank: int, server: int, what: str, error: BaseException | str) -> MicroDDPError:
    """The one error a worker raises when it loses its server."""
    detail = str(error).splitlines()[0][:160] if str(error) else type(error).__name__
    return MicroDDPError(f"worker rank {rank}: the parameter server (rank {server}) is gone "
                         f"while {what} ({detail}); a worker cannot go on without it: see rank "
                         f"{server}'s output for why it stopped, then rerun the job")
