"""A worker: pull parameters, compute a gradient on its shard, push it with the version it was
computed from, repeat until the server says stop. It never waits on the other workers, only on
the server, which holds back new parameters when the staleness bound says so."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from .. import spans
from ..timing import straggle
from .config import SERVER, PSConfig
from .protocol import (
    BYE,
    GRAD,
    STOP,
    flat_grads,
    flat_params,
    header,
    load_flat,
    recv,
    send,
    server_gone,
)
from .task import Task


@dataclass
class WorkerReport:
    """What one worker did: gradients pushed, seconds computing (straggling included) and
    seconds waiting for parameters."""

    rank: int
    gradients: int
    compute_s: float
    wait_s: float


def run_worker(rank: int, world_size: int, task: Task, config: PSConfig) -> WorkerReport:
    """The loop of worker `rank` (1..world_size-1); raises MicroDDPError if the server is gone."""
    model = task.make_model()
    numel = flat_params(model).numel()
    part, parts = rank - 1, world_size - 1
    factor = config.stragglers.get(rank, 1.0)
    pushed, compute_s, wait_s = 0, 0.0, 0.0
    while True:
        t0 = time.perf_counter()
        try:
            with spans.span("wait for parameters", track="comm_wait"):
                head, params = recv(SERVER, numel, config.server_timeout)
        except RuntimeError as e:  # gloo: connection closed, or nothing for server_timeout
            raise server_gone(rank, SERVER, "waiting for parameters", e) from None
        if pushed:  # the first pull also waits for the server to start: not a staleness wait
            wait_s += time.perf_counter() - t0
        if int(head[0]) == STOP:
            break
        version, clock = int(head[2]), int(head[3])
        if config.fail_after.get(rank) == pushed:
            os._exit(1)  # an injected crash: no goodbye, no cleanup, as a killed process
        t0 = time.perf_counter()
        load_flat(model, params)
        model.zero_grad(set_to_none=True)
        with spans.span("forward+backward"):
            loss, loss_sum, samples = task.shard_loss(model, clock, part, parts)
            loss.backward()
            grad = flat_grads(model)
        with spans.span("straggle"):  # a straggler: the same work, `factor` times as long
            straggle(time.perf_counter() - t0, factor)
        compute_s += time.perf_counter() - t0
        try:
            with spans.span("push gradient", track="comm"):
                send(header(GRAD, rank, version, clock, samples), SERVER,
                     torch.cat([grad, torch.tensor([loss_sum])]))
        except RuntimeError as e:
            raise server_gone(rank, SERVER, "sending a gradient", e) from None
        pushed += 1
        spans.next_step()
    try:
        send(header(BYE, rank, clock=pushed), SERVER)
    except RuntimeError as e:
        raise server_gone(rank, SERVER, "saying goodbye", e) from None
    return WorkerReport(rank, pushed, compute_s, wait_s)
