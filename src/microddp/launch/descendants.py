"""Every process a job's workers started, found and stopped when the job ends.

The launcher starts each worker in a process group of its own and signals the whole group, but
a child that calls setsid() (a daemon, a server a script starts "in the background",
`subprocess.Popen(..., start_new_session=True)`) leaves that group and outlived the job.
So the launcher also watches the process tree: while the job runs it notes every descendant of
every worker (pid and start time, so a reused pid is never signalled), and on Linux it becomes
a child subreaper (prctl PR_SET_CHILD_SUBREAPER) for the job's lifetime, so that a process
orphaned by a double fork is re-parented to the launcher instead of to init, where it would be
out of sight. At the end, what is still alive of those is sent SIGTERM, then SIGKILL.
Where /proc does not exist (macOS) this finds nothing and the process groups are all there is.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks since boot) of `pid`, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rpartition(")")[2].split()  # the name, in parentheses, may hold spaces
    try:
        return int(fields[1]), int(fields[19])
    except (IndexError, ValueError):
        return None


def _table() -> dict[int, tuple[int, int]]:
    """Every process's (parent, start time), by pid."""
    out = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if name.isdigit() and (st := _stat(int(name))) is not None:
            out[int(name)] = st
    return out


def _subreaper(on: bool) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux
        return False


class Descendants:
    """The processes started under a job's workers, for `stop` to end at the job's end."""

    def __init__(self) -> None:
        self.me = os.getpid()
        self.seen: dict[int, int] = {}  # pid -> start time
        self.since = int(time.clock_gettime(time.CLOCK_BOOTTIME) * _TICKS) \
            if hasattr(time, "CLOCK_BOOTTIME") else 0
        self.before = {p for p, (ppid, _) in _table().items() if ppid == self.me}
        self.reaping = _subreaper(True)

    def watch(self, workers: list[int]) -> None:
        """Note every living descendant of `workers`, and every orphan handed to us."""
        table = _table()
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        worker_set = set(workers)
        orphans = [pid for pid, (ppid, start) in table.items()  # re-parented to us
                   if ppid == self.me and pid not in worker_set and pid not in self.before
                   and start >= self.since and pid not in self.seen]
        for pid in orphans:
            self.seen[pid] = table[pid][1]
        todo = [*workers, *orphans]  # and everything below them
        while todo:
            for child in children.get(todo.pop(), ()):
                if child not in self.seen:
                    self.seen[child] = table[child][1]
                    todo.append(child)

    def alive(self) -> list[int]:
        """The noted processes still running (the same process: its start time matches)."""
        out = []
        for pid, start in self.seen.items():
            st = _stat(pid)
            if st is not None and st[1] == start and not _zombie(pid):
                out.append(pid)
        return out

    def stop(self, workers: list[int], grace: float = 2.0) -> list[int]:
        """SIGTERM what the job left running, SIGKILL it after `grace`; the pids it found."""
        self.watch(workers)
        left = self.alive()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in left:
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 2.0)
            while time.monotonic() < deadline:
                self._reap()
                if not self.alive():
                    break
                time.sleep(0.05)
        self._reap()
        if self.reaping:
            _subreaper(False)
        return left

    def _reap(self) -> None:
        """Collect the exit of the orphans that became our children (else they stay zombies);
        only those pids, never a worker that Popen still has to wait for."""
        for pid in self.seen:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except (OSError, IndexError):
        return False
