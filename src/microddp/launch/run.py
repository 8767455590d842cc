"""The launcher as a library: `launch(script, args, nproc=N)` starts N local workers of a
script with the environment torchrun gives them, as `microddp run`, `microddp train` and
`microddp hello` do.

Every output line gets a `[rank k]` prefix; if one worker fails the rest are stopped at once
(each with its process group), the failing rank's last lines are repeated, and the exit code is
non-zero; except an *expendable* rank (a parameter server's worker: the job is built to go on
without it), whose failure is reported and leaves the others running. `max_restarts=K` starts the whole group again after a failure, unless a worker exited
with 2 (a usage error: a restart would repeat it). SIGTERM, SIGINT, SIGHUP and SIGQUIT stop the
job (exit 128 + signal); so does a closed output pipe, quietly (exit 141, as `| head` expects).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..errors import MicroDDPError
from .descendants import Descendants
from .elastic_watch import ElasticWatch
from .procs import AgentStore, describe_exit, die_with_parent, kill_all, new_run_id, worker_env

MAX_WORKERS = 1024
TAIL_LINES = 40
MAX_PORT = 65535
USAGE_ERROR = 2  # a worker's exit code for a mistake in its input: restarting cannot help
PIPE_CLOSED = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader went away
# What torchrun's agent handles; SIGINT too, as KeyboardInterrupt. SIGKILL cannot be caught:
# then only the workers themselves die (PR_SET_PDEATHSIG), not their own children.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


class _Output:
    """This process's stdout, shared by the workers' reader threads, until its reader goes away.

    A closed pipe (`microddp run ... | head`) or a vanished terminal makes printing fail; the
    readers then keep draining the workers' pipes (a worker blocked on a full pipe would never
    exit) and the launcher stops the job, as a shell pipeline would.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.closed = threading.Event()

    def line(self, text: str) -> None:
        with self.lock:
            if self.closed.is_set():
                return
            try:
                print(text, flush=True)
            except OSError:  # EPIPE from a closed pipe, EIO from a closed terminal
                _discard_stdout()
                self.closed.set()


def _discard_stdout() -> None:
    """Point fd 1 at /dev/null, so flushing what is left in sys.stdout cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


class _Worker:
    def __init__(self, rank: int, cmd: list[str], env: dict, out: _Output):
        self.rank = rank
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            errors="replace", bufsize=1, start_new_session=True,
            preexec_fn=functools.partial(die_with_parent, os.getpid()),
        )
        self.reader = threading.Thread(target=self._pump, args=(out,), daemon=True)
        self.reader.start()

    def _pump(self, out: _Output) -> None:
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.tail.append(line)  # kept even when nobody reads: the failure report needs it
            out.line(f"[rank {self.rank}] {line}")


def _check_module(name: str) -> None:
    """Fail before starting any worker if `python -m name` would not find it (searched as the
    workers will search: the working folder first)."""
    saved = sys.path[:]
    sys.path.insert(0, os.getcwd())
    try:
        spec = importlib.util.find_spec(name)
        runnable = spec is None or spec.submodule_search_locations is None or \
            importlib.util.find_spec(f"{name}.__main__") is not None
    except (ImportError, ValueError):  # a parent package is missing, or the name is malformed
        spec = None
    finally:
        sys.path[:] = saved
    if spec is None:
        raise MicroDDPError(f"no module named {name!r} (for -m); check the name, the working "
                            "folder, and that its package is installed")
    if not runnable:
        raise MicroDDPError(f"{name!r} is a package without __main__.py, so -m cannot run it; "
                            "name a module inside it")


def _command(script: str, script_args: list[str], module: bool) -> list[str]:
    if module:
        _check_module(script)
        return [sys.executable, "-u", "-m", script, *script_args]
    path = Path(script)
    if path.is_dir():
        raise MicroDDPError(f"script {script!r} is a folder; give the path to a .py file")
    if not path.is_file():
        raise MicroDDPError(f"script {script!r} does not exist; give the path to a .py file")
    return [sys.executable, "-u", str(path), *script_args]


# An expendable rank that exits with this code says a rank the job cannot lose is gone (a
# parameter server's worker whose server stopped answering): that stops the job, as the lost
# rank's own failure would, had it been able to fail (a frozen process never exits). 75 is
# sysexits' EX_TEMPFAIL: a failure a restart may cure; rare enough not to be a script's own.
PEER_GONE = 75
# Once every rank that is not expendable has ended well, an expendable one still running this
# long after is stopped (a worker frozen and dropped by its server would never end by itself).
LEFTOVER_S = 10.0


def _run_once(cmd: list[str], n: int, port: int, restart: int, max_restarts: int,
              run_id: str, out: _Output, expendable: frozenset[int] = frozenset(),
              elastic: bool = False, replacements: int = 0) -> int:
    """One attempt: start all workers, wait; on the first failure of a rank that is not
    expendable stop the rest (elastic: none stops the rest, launch/elastic_watch.py)."""
    agent = AgentStore.start(port)
    watch = ElasticWatch(agent, n, replacements) if elastic else None
    envs = [worker_env(os.environ, r, n, agent, restart, max_restarts, run_id=run_id)
            for r in range(n)]
    tree = Descendants()  # before the workers: what they start, setsid or not, ends with them
    workers = [_Worker(r, cmd, env, out) for r, env in enumerate(envs)]
    pids = [w.proc.pid for w in workers]
    let_go: set[int] = set()
    polls, ended = 0, 0.0
    try:
        while not out.closed.is_set():
            if polls % 10 == 0:
                tree.watch(pids)
            polls += 1
            codes = [w.proc.poll() for w in workers]
            if watch is not None:
                code = watch.poll(codes)
                if code is not None:
                    return code
                for slot, member in watch.take_replacements():  # the lost rank's slot, a new id
                    print(f"microddp run: starting id {member} in slot {slot} (a replacement; "
                          f"it joins the others at a step boundary)", file=sys.stderr, flush=True)
                    env = {**envs[slot], **watch.replacement_env(member)}
                    workers.append(_Worker(member, cmd, env, out))
                    pids.append(workers[-1].proc.pid)
                time.sleep(0.05)
                continue
            failed = [w for w, c in zip(workers, codes, strict=True) if c not in (None, 0)]
            spared = [w for w in failed if w.rank in expendable
                      and w.proc.returncode != PEER_GONE]
            failed = [w for w in failed if w not in spared]
            for w in spared if not failed else ():  # else they only followed the one that failed
                if w.rank not in let_go:
                    let_go.add(w.rank)
                    _report_expendable(w)
            if failed:
                first = failed[0]
                kill_all([(w.proc.pid, lambda w=w: w.proc.poll() is None) for w in workers])
                _report(first, workers)
                code = first.proc.returncode
                return code if code > 0 else 128 - code
            if all(c == 0 or w.rank in let_go for w, c in zip(workers, codes, strict=True)):
                return 0
            if expendable and expendable <= let_go:
                # every rank the job could lose is lost: a live job ends itself now (a server
                # left without workers says so and exits); one still running is frozen
                ended = ended or time.monotonic()
                if time.monotonic() - ended > LEFTOVER_S:
                    left = [w for w, c in zip(workers, codes, strict=True) if c is None]
                    print(f"microddp run: every expendable rank failed and rank(s) "
                          f"{', '.join(str(w.rank) for w in left)} did not end within "
                          f"{LEFTOVER_S:g} s (frozen?); stopped them", file=sys.stderr)
                    kill_all([(w.proc.pid, lambda w=w: w.proc.poll() is None) for w in left],
                             grace=1)
                    return 1
            elif expendable and all(c == 0 for w, c in zip(workers, codes, strict=True)
                                    if w.rank not in expendable):
                ended = ended or time.monotonic()
                if time.monotonic() - ended > LEFTOVER_S:
                    _stop_leftovers([w for w, c in zip(workers, codes, strict=True)
                                     if c is None])
                    return 0
            time.sleep(0.05)
        return PIPE_CLOSED
    finally:
        kill_all([(w.proc.pid, lambda w=w: w.proc.poll() is None) for w in workers], grace=1)
        tree.stop(pids, grace=1)
        for w in workers:
            w.reader.join(timeout=2)
        if watch is not None:
            watch.close()
        agent.close()


def _stop_leftovers(left: list[_Worker]) -> None:
    ranks = ", ".join(str(w.rank) for w in left)
    print(f"microddp run: rank(s) {ranks} still running {LEFTOVER_S:g} s after the job's other "
          "ranks ended well (frozen, and dropped by the job); stopped them", file=sys.stderr)
    kill_all([(w.proc.pid, lambda w=w: w.proc.poll() is None) for w in left], grace=1)


def _report(first: _Worker, workers: list[_Worker]) -> None:
    for w in workers:
        w.reader.join(timeout=2)  # let the failing rank's last lines reach the screen first
    failed = f"microddp run: rank {first.rank} failed ({describe_exit(first.proc.returncode)})"
    # Often only rank 0 prints: then say so rather than promise lines that never come.
    tail = "Its last lines:" if first.tail else "It printed nothing."
    hang = _hang_report(first, workers)
    if hang:
        # After a hang, the monitor's report says where every rank is; the failing rank's
        # traceback (often from gloo's C++) only says that its wait ended: it comes second.
        print(f"{failed} after a hang; stopped the other ranks. The monitor's report:",
              file=sys.stderr)
        for line in hang:
            print(f"  {line}", file=sys.stderr)
        print(f"microddp run: rank {first.rank}'s output. {tail}", file=sys.stderr)
    else:
        print(f"{failed}; stopped the other ranks. {tail}", file=sys.stderr)
    for line in first.tail:
        print(f"  [rank {first.rank}] {line}", file=sys.stderr)
    for needle, hint in HINTS.items():
        if any(needle in line for line in first.tail):
            print(f"microddp run: {hint}", file=sys.stderr)


# What a failing rank's last lines show, and what to do about it, where torch's words do not say.
HINTS = {
    # the same words as microddp.backend.IMPORT_HINT (that module imports torch; this one not)
    "Unknown backend type microddp": 'the "microddp" backend is registered by `import '
    'microddp.backend`: add that line before dist.init_process_group("microddp")',
}


def _report_expendable(w: _Worker) -> None:
    w.reader.join(timeout=2)
    print(f"microddp run: rank {w.rank} failed ({describe_exit(w.proc.returncode)}); it is "
          "expendable, so the others go on without it. "
          + ("Its last lines:" if w.tail else "It printed nothing."), file=sys.stderr)
    for line in w.tail:
        print(f"  [rank {w.rank}] {line}", file=sys.stderr)


def _hang_report(first: _Worker, workers: list[_Worker]) -> list[str]:
    """The monitor's hang report from the failing rank's output, else from another rank's (the
    rank that reported may not be the one that failed first)."""
    from ..monitor.hang import find_report  # noqa: PLC0415 (only after a failure)

    for w in [first, *(w for w in workers if w is not first)]:
        found = find_report(list(w.tail))
        if found:
            return found
    return []


def _on_signal(signum: int, _frame) -> None:
    """Unwind through the `finally` that stops the workers and their process groups."""
    for sig in (*STOP_SIGNALS, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)  # one stop is enough: let the cleanup finish
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _signals_stop_the_job():
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers; its caller owns the signals then
        return
    before = {sig: signal.signal(sig, _on_signal) for sig in (*STOP_SIGNALS, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def launch(script: str, script_args: Sequence[str] = (), *, nproc: int, module: bool = False,
           max_restarts: int = 0, master_port: int = 0, expendable: Iterable[int] = (),
           elastic: bool = False, replacements: int = 0) -> int:
    """Run `script` (a module name with module=True, as `python -m`) on `nproc` local workers,
    restarting all of them up to `max_restarts` times; return the job's exit code.

    `master_port` 0 picks a free port. `expendable` ranks may fail without stopping the others
    (a parameter server's workers): their failure is reported, and the job's exit code is the
    other ranks'. The errors name the `microddp run` flags, since the command line is how most
    people reach this.
    """
    n = nproc
    if not 1 <= n <= MAX_WORKERS:
        raise MicroDDPError(f"--nproc must be between 1 and {MAX_WORKERS}, got {n}")
    if max_restarts < 0:
        raise MicroDDPError(f"--max-restarts must be 0 or more, got {max_restarts}")
    if not 0 <= master_port <= MAX_PORT:
        raise MicroDDPError(f"--master-port must be between 0 and {MAX_PORT} (0: a free one), "
                            f"got {master_port}")
    spare = frozenset(expendable)
    if not spare <= set(range(n)) or len(spare) == n:
        raise MicroDDPError(f"--expendable {','.join(map(str, sorted(spare)))}: each must be a "
                            f"rank of 0..{n - 1}, and at least one rank must not be expendable")
    cmd = _command(script, list(script_args), module)
    out, run_id = _Output(), new_run_id()
    with _signals_stop_the_job():
        for attempt in range(max_restarts + 1):
            code = _run_once(cmd, n, master_port, attempt, max_restarts, run_id, out, spare,
                             elastic, replacements)
            if out.closed.is_set():
                return PIPE_CLOSED  # nobody reads any more: stop quietly, never restart
            if code == 0:
                return 0
            if code == USAGE_ERROR and attempt < max_restarts:
                print("microddp run: not restarting: exit code 2 is a usage error (microddp's "
                      "and argparse's code for a mistake in the input), which a restart would "
                      "only repeat", file=sys.stderr)
                return code
            if attempt < max_restarts:
                print(f"microddp run: restarting all {n} workers "
                      f"(restart {attempt + 1} of {max_restarts})", file=sys.stderr)
    return code
