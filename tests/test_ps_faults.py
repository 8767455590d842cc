"""Faults, with real processes: a worker that crashes is dropped and recorded, and the others
finish the run; a server that crashes ends every worker with one clear MicroDDPError.

mdp.spawn stops the whole job as soon as any rank dies, which is right for data parallelism
and exactly what a parameter server must not do; so these tests start their ranks with plain
multiprocessing and collect each rank's outcome (result, error or exit code) on its own.
"""

import multiprocessing as mp
import os
import queue
import threading

import torch

import microddp as mdp
from microddp import ps
from microddp.data import load_dataset
from microddp.errors import MicroDDPError

DEADLINE_S = 90


def make_model():
    torch.manual_seed(0)
    return mdp.FullMLP(16, 2, n_classes=10, in_features=64)


def task():
    data = load_dataset("digits")
    return ps.Task(make_model, data.train, 48, data.test)


def _rank(rank, world_size, store, fn, args, results):
    os.environ["MICRODDP_MONITOR"] = "0"  # a dead rank is the point here, not a hang to report
    world = mdp.init(backend="gloo", init_method=f"file://{store}", rank=rank,
                     world_size=world_size, timeout=60)
    try:
        results.put((rank, "ok", fn(world, *args)))
    except MicroDDPError as e:
        results.put((rank, "error", str(e)))
    mdp.shutdown()


def run_tolerant(fn, world_size, args, tmp_path):
    """{rank: ("ok", value) | ("error", message) | ("exit", code)}, every rank stopped."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world_size, str(tmp_path / "store"), fn, args,
                                             results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out = {}
    try:
        for p in procs:
            p.join(DEADLINE_S)
        while True:
            rank, status, value = results.get(timeout=1)
            out[rank] = (status, value)
    except queue.Empty:
        pass
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    for rank, p in enumerate(procs):
        out.setdefault(rank, ("exit", p.exitcode))
    return out


def job(world, config):
    report = ps.run(world, task(), config)
    if world.rank != ps.SERVER:
        return report.gradients
    return {"lost": report.lost, "reasons": report.lost_reasons, "applied": report.applied,
            "per_update": report.per_update}


def test_a_crashed_worker_is_dropped_recorded_and_the_run_finishes(tmp_path):
    config = ps.PSConfig(steps=8, staleness=0, fail_after={2: 3}, worker_timeout=30)
    out = run_tolerant(job, 3, (config,), tmp_path)
    assert out[2] == ("exit", 1)  # os._exit(1): no result, no goodbye
    status, server = out[0]
    assert status == "ok"
    # Synchronous: three full steps, then worker 2 dies before its 4th gradient, at version 3.
    assert server["lost"] == [(2, 3)]
    assert server["reasons"][2]  # why it was dropped (gloo: connection closed)
    assert server["per_update"][:3] == [2, 2, 2] and set(server["per_update"][3:]) == {1}
    assert server["applied"] == 8 * 2
    assert out[1] == ("ok", 16 - 3)  # the survivor did the rest


def _serve_then_crash(world, config):
    if world.rank == ps.SERVER:
        threading.Timer(1.5, os._exit, (1,)).start()  # crash mid-run, wherever it is
    return job(world, config)


def test_a_crashed_server_ends_every_worker_with_one_clear_error(tmp_path):
    config = ps.PSConfig(steps=100_000, staleness=0, stragglers={2: 2.0}, server_timeout=20)
    out = run_tolerant(_serve_then_crash, 3, (config,), tmp_path)
    assert out[0] == ("exit", 1)
    for rank in (1, 2):
        status, message = out[rank]
        assert status == "error"
        assert message.startswith(f"worker rank {rank}: the parameter server (rank 0) is gone")
        assert "rerun" in message and "\n" not in message
