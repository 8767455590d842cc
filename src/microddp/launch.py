"""Start N local workers of a script, as torchrun does: `microddp run -n N script.py [args]`.

Starts N workers with the environment torchrun gives them, prefixes every output line with
`[rank k]`, and if one worker fails stops the rest at once, repeats the failing rank's last
lines, and exits non-zero. `--max-restarts K` starts the whole group again after a failure.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

from .errors import MicroDDPError
from .procs import AgentStore, describe_exit, die_with_parent, kill_all, worker_env

MAX_WORKERS = 1024
TAIL_LINES = 40

EPILOG = """\
examples:
  microddp run -n 2 train.py --epochs 3        # 2 local workers
  microddp run -n 4 --max-restarts 2 job.py    # restart all workers if one dies

many hosts: microddp scripts run unchanged under torchrun, e.g. on each of 2 hosts
  torchrun --nnodes 2 --nproc-per-node 4 --node-rank R \\
           --rdzv-backend c10d --rdzv-endpoint HOST0:29400 train.py
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--nproc", type=int, default=2, help="number of workers (default 2)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart all workers up to K times after a failure (default 0)")
    p.add_argument("--master-port", type=int, default=0,
                   help="rendezvous port on 127.0.0.1 (default: a free one)")
    p.add_argument("-m", dest="module", action="store_true",
                   help="treat SCRIPT as a module name, as `python -m` does")
    p.add_argument("script", help="the Python script (or module, with -m) each worker runs")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


class _Worker:
    def __init__(self, rank: int, cmd: list[str], env: dict, out_lock: threading.Lock):
        self.rank = rank
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            errors="replace", bufsize=1, start_new_session=True,
            preexec_fn=functools.partial(die_with_parent, os.getpid()),
        )
        self.reader = threading.Thread(target=self._pump, args=(out_lock,), daemon=True)
        self.reader.start()

    def _pump(self, lock: threading.Lock) -> None:
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.tail.append(line)
            with lock:
                print(f"[rank {self.rank}] {line}", flush=True)


def _command(args: argparse.Namespace) -> list[str]:
    if args.module:
        return [sys.executable, "-u", "-m", args.script, *args.script_args]
    path = Path(args.script)
    if not path.is_file():
        raise MicroDDPError(f"script {args.script!r} does not exist; give the path to a .py file")
    return [sys.executable, "-u", str(path), *args.script_args]


def _run_once(cmd: list[str], n: int, port: int, restart: int, max_restarts: int) -> int:
    """One attempt: start all workers, wait; on the first failure stop the rest."""
    agent = AgentStore.start(port)
    lock = threading.Lock()
    workers = [_Worker(r, cmd, worker_env(os.environ, r, n, agent, restart, max_restarts), lock)
               for r in range(n)]
    try:
        while True:
            codes = [w.proc.poll() for w in workers]
            failed = [w for w, c in zip(workers, codes, strict=True) if c not in (None, 0)]
            if failed:
                first = failed[0]
                kill_all([(w.proc.pid, lambda w=w: w.proc.poll() is None) for w in workers])
                _report(first, workers)
                code = first.proc.returncode
                return code if code > 0 else 128 - code
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.05)
    finally:
        kill_all([(w.proc.pid, lambda w=w: w.proc.poll() is None) for w in workers], grace=1)
        for w in workers:
            w.reader.join(timeout=2)
        del agent


def _report(first: _Worker, workers: list[_Worker]) -> None:
    for w in workers:
        w.reader.join(timeout=2)  # let the failing rank's last lines reach the screen first
    print(f"microddp run: rank {first.rank} failed ({describe_exit(first.proc.returncode)}); "
          "stopped the other ranks. Its last lines:", file=sys.stderr)
    for line in first.tail:
        print(f"  [rank {first.rank}] {line}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """Launch the workers, restarting up to --max-restarts times; return the exit code."""
    n = args.nproc
    if not 1 <= n <= MAX_WORKERS:
        raise MicroDDPError(f"--nproc must be between 1 and {MAX_WORKERS}, got {n}")
    if args.max_restarts < 0:
        raise MicroDDPError(f"--max-restarts must be 0 or more, got {args.max_restarts}")
    cmd = _command(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally: stop workers
    for attempt in range(args.max_restarts + 1):
        code = _run_once(cmd, n, args.master_port, attempt, args.max_restarts)
        if code == 0:
            return 0
        if attempt < args.max_restarts:
            print(f"microddp run: restarting all {n} workers "
                  f"(restart {attempt + 1} of {args.max_restarts})", file=sys.stderr)
    return code
