"""The messages between the server and its workers, and how they move: point-to-point only.

Every message is a small int64 header, then (for parameters and gradients) one flat float32
tensor. Header: [kind, sender, version, clock, samples]: the version is the parameter version
the payload was computed from (gradients) or is (parameters); clock is the global batch the
worker computes next (parameters: the server owns every worker's place in the data, so a
resumed server puts its workers back where they were) or computed (gradients). A gradient's
payload ends with one more number, the shard's summed loss, for the server's progress lines.

The server listens to each worker on a thread of its own (`Inbox`): gloo's receive work does
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

PARAMS, STOP, GRAD, BYE, LOST = range(5)
HEADER_LEN = 5
TAG_HEADER, TAG_PAYLOAD = 1, 2


def header(kind: int, sender: int, version: int = 0, clock: int = 0,
           samples: int = 0) -> torch.Tensor:
    """The fixed-size int64 header every parameter-server message starts with."""
    return torch.tensor([kind, sender, version, clock, samples], dtype=torch.int64)


def flat_params(model: nn.Module) -> torch.Tensor:
    """All parameters in one float32 tensor, in model.parameters() order."""
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


def flat_grads(model: nn.Module) -> torch.Tensor:
    """All gradients in one float32 tensor (zeros for a parameter without one), in parameter
    order."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in model.parameters()]).float()


@torch.no_grad()
def load_flat(model: nn.Module, flat: torch.Tensor, into_grad: bool = False) -> None:
    """Copy a flat tensor back into the parameters (or their .grad)."""
    offset = 0
    for p in model.parameters():
        part = flat[offset:offset + p.numel()].view_as(p).to(p.dtype)
        if into_grad:
            p.grad = part.clone()
        else:
            p.copy_(part)
        offset += p.numel()


def send(head: torch.Tensor, dst: int, payload: torch.Tensor | None = None) -> None:
    """Send a header to `dst`, then its payload if there is one."""
    comms.send(head, dst, tag=TAG_HEADER)
    if payload is not None:
        comms.send(payload, dst, tag=TAG_PAYLOAD)


def recv(src: int, numel: int, timeout: float, into: torch.Tensor | None = None
         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One message from `src`; raises RuntimeError (gloo's) if `src` is gone or silent for
    `timeout` seconds. Parameters are received into `into` when given (a worker's flat
    parameters, which the model's are views of), a gradient into a new tensor."""
    head = torch.zeros(HEADER_LEN, dtype=torch.int64)
    comms.irecv(head, src, tag=TAG_HEADER).wait(timedelta(seconds=timeout))
    payload = None
    if int(head[0]) in (PARAMS, GRAD):
        kind = int(head[0])
        payload = into if kind == PARAMS and into is not None else \
            torch.empty(numel + (kind == GRAD), dtype=torch.float32)
        comms.irecv(payload, src, tag=TAG_PAYLOAD).wait(timedelta(seconds=timeout))
    return head, payload


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
            try:
                head, payload = recv(worker, numel, timeout)
            except RuntimeError as e:  # gloo: connection closed by the peer, or timed out
                self.messages.put(Message(LOST, worker, error=str(e).splitlines()[0][:200]))
                return
            kind, sender, version, clock, samples = (int(v) for v in head)
            if sender != worker or kind not in (GRAD, BYE):
                self.messages.put(Message(LOST, worker, error=f"unexpected header "
                                          f"{head.tolist()}: not a microddp.ps worker?"))
                return
            loss = 0.0
            if kind == GRAD:
                payload, loss = payload[:-1], float(payload[-1])
            self.messages.put(Message(kind, worker, version, clock, samples, payload, loss))
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
