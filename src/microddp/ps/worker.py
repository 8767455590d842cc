"""A worker: pull parameters (one shard from each server), compute a gradient on its part of the
global batch, push each server its shard of the gradient with the version it was computed from,
repeat until a server says stop. It never waits on the other workers, only on the servers,
which hold back new parameters when the staleness bound says so."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from .. import spans
from ..timing import straggle
from .config import PSConfig
from .flat import FlatModel
from .protocol import BYE, GRAD, STOP, recv, send, server_gone
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
    """The loop of worker `rank` (config.servers..world_size-1); raises MicroDDPError if a
    server is gone."""
    model = task.make_model()
    # parameters received in place, gradients pushed from where backward leaves them, one
    # frame per server's shard; the slot past each shard's last gradient carries the loss
    servers = range(config.servers)
    flat = FlatModel(model, extra=1, shards=config.servers)
    part, parts = rank - config.servers, world_size - config.servers
    factor = config.stragglers.get(rank, 1.0)
    versions = [0] * config.servers  # the version of each shard this gradient is computed on
    pushed, compute_s, wait_s, stop = 0, 0.0, 0.0, False
    while True:
        t0 = time.perf_counter()
        with spans.span("wait for parameters", track="comm_wait"):
            for s in servers:
                try:
                    kind, _, versions[s], clock, _ = recv(flat.param_frames[s], s,
                                                          config.server_timeout)
                except RuntimeError as e:  # gloo: connection closed, or nothing for the timeout
                    raise server_gone(rank, s, "waiting for parameters", e) from None
                stop = stop or kind == STOP  # every shard's answer is read: none is left queued
        if pushed:  # the first pull also waits for the server to start: not a staleness wait
            wait_s += time.perf_counter() - t0
        if stop:
            break
        if config.fail_after.get(rank) == pushed:
            os._exit(1)  # an injected crash: no goodbye, no cleanup, as a killed process
        t0 = time.perf_counter()
        flat.zero_grad()
        with spans.span("forward+backward"):
            loss, loss_sum, samples = task.shard_loss(model, clock, part, parts)
            loss.backward()
        with spans.span("straggle"):  # a straggler: the same work, `factor` times as long
            straggle(time.perf_counter() - t0, factor)
        compute_s += time.perf_counter() - t0
        with spans.span("push gradient", track="comm"):
            for s in servers:
                f = flat.grad_frames[s]
                f.body[-1] = loss_sum
                try:
                    send(f, s, GRAD, rank, versions[s], clock, samples)
                except RuntimeError as e:
                    raise server_gone(rank, s, "sending a gradient", e) from None
        pushed += 1
        spans.next_step()
    for s in servers:
        try:
            send(flat.grad_frames[s], s, BYE, rank, clock=pushed)
        except RuntimeError as e:
            raise server_gone(rank, s, "saying goodbye", e) from None
    return WorkerReport(rank, pushed, compute_s, wait_s)
