"""`spawn(fn, world_size)`: run a Python function on N local ranks and collect what each returns.

What the tests, the benchmarks and the course use. Unlike `torch.multiprocessing.spawn`, every
rank joins the process group before `fn` runs, the whole job has a deadline, and a failing rank
stops the others at once and reports its own traceback.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

from ..errors import MicroDDPError
from .procs import AgentStore, describe_exit, die_with_parent, kill_all, new_run_id, worker_env


class _Stdio:
    """This process's stdout and stderr, handed to a rank whatever its start method: a
    forkserver child would otherwise write wherever the server's output went when it started."""

    def __reduce__(self):
        return (_Stdio._received, (reduction.DupFd(1), reduction.DupFd(2)))

    @staticmethod
    def _received(out, err) -> tuple[int, int]:
        # forkserver sends a duplicate to detach; spawn passes the descriptor number itself
        return tuple(fd.detach() if hasattr(fd, "detach") else fd for fd in (out, err))


class _Lifeline:
    """A pipe whose write end only the caller holds; a rank reads the other end.

    The kernel closes the write end when the caller exits in any way, even by SIGKILL, and the
    rank's read returns EOF. PR_SET_PDEATHSIG cannot tell: it watches the OS parent, which for
    a forkserver rank is the server, and the server lives on while ranks hold its own pipe.
    """

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()  # neither is inherited by exec'd programs

    def __reduce__(self):
        return (_Lifeline._received, (reduction.DupFd(self.read_fd),))

    @staticmethod
    def _received(fd) -> int:
        return fd.detach() if hasattr(fd, "detach") else fd


def _die_with_caller(lifeline: int | _Lifeline) -> None:
    """Exit as soon as the caller of spawn() is gone (a daemon thread waiting for EOF)."""
    if isinstance(lifeline, _Lifeline):  # started by fork: both ends were inherited
        os.close(lifeline.write_fd)
        lifeline = lifeline.read_fd

    def watch() -> None:
        while os.read(lifeline, 1):
            pass
        os._exit(1)

    threading.Thread(target=watch, name="microddp-lifeline", daemon=True).start()


class _Terminated(BaseException):
    """SIGTERM arrived while spawn() ran: unwind through its cleanup first."""


def _on_sigterm(_signum, _frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one is enough: let the cleanup finish
    raise _Terminated


@contextlib.contextmanager
def _sigterm_stops_ranks():
    """With SIGTERM's default action the caller would die without stopping its ranks; stop them,
    then die of SIGTERM all the same. A handler the program set itself is left alone."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        raise SystemExit(128 + signal.SIGTERM) from None  # only if another thread got the signal
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _redirect(fds: tuple[int, int] | _Stdio) -> None:
    if isinstance(fds, _Stdio):
        return  # started by fork: the descriptors were inherited, nothing was pickled
    for target, fd in zip((1, 2), fds, strict=True):
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)


def _worker(rank: int, world_size: int, env: dict, fn: Callable, args: tuple, results,
            backend: str | None, timeout: float, join: bool, stdio: tuple[int, int],
            lifeline: int) -> None:
    _redirect(stdio)
    _die_with_caller(lifeline)
    die_with_parent()
    os.environ.clear()
    os.environ.update(env)
    import torch  # here, not above: `microddp run`'s launcher imports this module, needs no torch

    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    from .. import comms
    from ..world import world

    world._world = None  # a forked child must not inherit its parent's world
    try:
        w = comms.init(backend=backend, timeout=timeout) if join else rank
        # Plain pickle copies tensors; torch's queue reducers would share memory through file
        # descriptors that vanish when this process exits before the parent reads them.
        out = pickle.dumps(fn(w, *args))
        # What the rank printed must be out before the parent hears it finished: the parent
        # may stop the ranks as soon as every result is in, and a block-buffered stdout (any
        # shell without PYTHONUNBUFFERED) would lose the rank's last lines with the process.
        sys.stdout.flush()
        sys.stderr.flush()
        results.put((rank, "ok", out))
    except BaseException as e:  # report anything, including SystemExit, to the parent
        text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{text}"))
        sys.stdout.flush()
        sys.stderr.flush()
        results.close()
        results.join_thread()
        os._exit(1)
    comms.shutdown()


def _context(start_method: str | None):
    """forkserver on Linux: ranks fork from a clean, single-threaded server that has already
    imported torch, so they start fast and inherit none of this process's threads or locks
    (forking a multi-threaded parent can deadlock the child: GNU OpenMP, held locks)."""
    if start_method is None:
        start_method = "forkserver" if sys.platform == "linux" else "spawn"
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        # comms first: `import microddp` no longer imports it (nor torch), and every rank needs
        # both, imported once in the server rather than once per rank.
        preload = ["microddp.comms", "microddp.launch.spawn"]
        # torch._dynamo too if the caller has it: a first torch.optim optimizer imports it
        # (Optimizer.__init__ is wrapped to keep dynamo out), at a cost above torch's own
        # (1.2 s against 1.0 s on an idle core here), which every rank that trains would pay
        # again. Not always: a script whose ranks only communicate would pay it for nothing.
        if "torch._dynamo" in sys.modules:
            preload.append("torch._dynamo")
        ctx.set_forkserver_preload(preload)
    return ctx


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
    if getattr(mp.current_process(), "_inheriting", False):
        # A rank starting up re-imports the caller's script; a spawn() at its top level would
        # start ranks from every rank, for ever. multiprocessing's own message for this names
        # neither the script nor the fix.
        raise MicroDDPError(
            f"microddp.launch.spawn() ran while a rank was importing {sys.argv[0] or 'your script'}: "
            "put the call under `if __name__ == \"__main__\":`, so that it runs only in the "
            "process you started")
    _warn_if_launched(world_size)
    with _sigterm_stops_ranks():
        return _run(fn, world_size, args, timeout, backend, _context(start_method), join)


_warned = False


def _warn_if_launched(world_size: int) -> None:
    """Under `microddp run` or torchrun every worker would start a world of its own: the job
    runs once per worker (a chapter script run with the launcher). Say so, once per process."""
    global _warned
    if _warned or not os.environ.get("TORCHELASTIC_RUN_ID") or "WORLD_SIZE" not in os.environ:
        return
    _warned = True
    print(f"microddp.launch.spawn: warning: this process is already rank {os.environ.get('RANK')} of "
          f"{os.environ['WORLD_SIZE']} started by a launcher, and starts {world_size} ranks of "
          "its own, so every launched rank runs the whole job; run a script that starts its "
          "own ranks (every course script does) with plain `python script.py`",
          file=sys.stderr, flush=True)


def _run(fn: Callable, world_size: int, args: tuple, timeout: float, backend: str | None,
         ctx, join: bool) -> list[Any]:
    agent = AgentStore.start(timeout=timeout)
    run_id = new_run_id()
    envs = [worker_env(os.environ, rank, world_size, agent, run_id=run_id)
            for rank in range(world_size)]
    results = ctx.Queue()
    lifeline = _Lifeline()
    procs = []
    try:
        for rank, env in enumerate(envs):
            p = ctx.Process(target=_worker, daemon=True,
                            args=(rank, world_size, env, fn, args, results, backend, timeout, join,
                                  _Stdio(), lifeline))
            p.start()
            procs.append(p)
        os.close(lifeline.read_fd)  # every rank has its own copy now
        lifeline.read_fd = -1
        return _collect(procs, results, world_size, timeout)
    finally:
        kill_all([(p.pid, p.is_alive) for p in procs if p.pid], grace=1.0, groups=False)
        for p in procs:
            p.join(timeout=5)
        for fd in (lifeline.read_fd, lifeline.write_fd):
            if fd >= 0:
                os.close(fd)
        agent.close()


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
                                        "without reporting a result; any error it printed is "
                                        "above")
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

