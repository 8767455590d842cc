"""`spawn(fn, world_size)`: run a Python function on N local ranks and collect what each returns.

What the tests, the benchmarks and the course use. Unlike `torch.multiprocessing.spawn`, every
rank joins the process group before `fn` runs, the whole job has a deadline, and a failing rank
stops the others at once and reports its own traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from .errors import MicroDDPError
from .procs import AgentStore, describe_exit, die_with_parent, kill_all, worker_env


def _worker(rank: int, world_size: int, env: dict, fn: Callable, args: tuple, results,
            backend: str | None, timeout: float, join: bool) -> None:
    die_with_parent()
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    from . import world  # noqa: PLC0415 (imported after the environment is in place)

    world._world = None  # a forked child must not inherit its parent's world
    try:
        w = world.init(backend=backend, timeout=timeout) if join else rank
        # Plain pickle copies tensors; torch's queue reducers would share memory through file
        # descriptors that vanish when this process exits before the parent reads them.
        results.put((rank, "ok", pickle.dumps(fn(w, *args))))
    except BaseException as e:  # report anything, including SystemExit, to the parent
        text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{text}"))
        results.close()
        results.join_thread()
        os._exit(1)
    world.shutdown()


def _start_method(threads_per_rank: int) -> str:
    """fork is fast (no re-import of torch), but unsafe once CUDA is initialised, and GNU
    OpenMP deadlocks in a forked child that starts a thread pool after the parent used one."""
    if sys.platform == "linux" and not torch.cuda.is_initialized() and threads_per_rank == 1:
        return "fork"
    return "spawn"


def spawn(fn: Callable[..., Any], world_size: int, args: tuple = (), *,
          timeout: float = 120.0, backend: str | None = None,
          start_method: str | None = None, join: bool = True) -> list[Any]:
    """Run `fn(world, *args)` on `world_size` ranks; return the results, indexed by rank.

    With `join=False` the ranks do not join a process group first: `fn(rank, *args)` gets its
    rank and torchrun's environment, and rendezvouses however it likes.

    Raises MicroDDPError naming the rank and showing its traceback if any rank fails, or naming
    the ranks still running if the deadline passes. No rank outlives this call.
    """
    if world_size < 1:
        raise MicroDDPError(f"world size must be at least 1, got {world_size}")
    agent = AgentStore.start(timeout=timeout)
    envs = [worker_env(os.environ, rank, world_size, agent) for rank in range(world_size)]
    ctx = mp.get_context(start_method or _start_method(int(envs[0]["OMP_NUM_THREADS"])))
    results = ctx.Queue()
    procs = []
    try:
        for rank, env in enumerate(envs):
            p = ctx.Process(target=_worker, daemon=True,
                            args=(rank, world_size, env, fn, args, results, backend, timeout, join))
            p.start()
            procs.append(p)
        return _collect(procs, results, world_size, timeout)
    finally:
        kill_all([(p.pid, p.is_alive) for p in procs if p.pid], grace=1.0, groups=False)
        for p in procs:
            p.join(timeout=5)
        del agent


def _collect(procs, results, world_size: int, timeout: float) -> list[Any]:
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(out) < world_size:
        try:
            rank, status, value = results.get(timeout=0.2)
        except queue.Empty:
            rank = None
        if rank is not None:
            if status == "error":
                raise MicroDDPError(f"rank {rank} failed: {value}")
            out[rank] = pickle.loads(value)
            continue
        for rank, p in enumerate(procs):
            if rank not in out and not p.is_alive() and p.exitcode is not None:
                _drain(results, out)
                if rank not in out:
                    raise MicroDDPError(f"rank {rank} died ({describe_exit(p.exitcode)}) "
                                        "without reporting a result")
        if time.monotonic() > deadline:
            missing = sorted(set(range(world_size)) - set(out))
            raise MicroDDPError(f"ranks {missing} did not finish within {timeout:g} s; "
                                "a rank is probably stuck in a collective the others skipped")
    return [out[r] for r in range(world_size)]


def _drain(results, out: dict) -> None:
    """Pick up a result that arrived just before its process exited."""
    try:
        while True:
            rank, status, value = results.get(timeout=0.5)
            if status == "error":
                raise MicroDDPError(f"rank {rank} failed: {value}")
            out[rank] = pickle.loads(value)
    except queue.Empty:
        pass

