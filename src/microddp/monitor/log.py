"""Each rank's short memory of its collectives: number, op, shape, dtype, and who called it.

Enough to say, when a job hangs, which collective each rank is in and which Python line sent
it there. Frames inside torch, the standard library and microddp's own plumbing are skipped, so
the caller named is the line a person would want to look at.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch

_PLUMBING = tuple(os.path.normcase(os.path.abspath(p)) + os.sep for p in {
    os.path.dirname(torch.__file__),
    os.path.dirname(__file__),
    sysconfig.get_paths()["stdlib"],
})
_COMMS = os.path.normcase(os.path.join(os.path.dirname(os.path.dirname(__file__)), "comms", "ops.py"))


@functools.lru_cache(maxsize=4096)  # called for every frame of every collective: keep it cheap
def _is_plumbing(filename: str) -> bool:
    f = os.path.normcase(os.path.abspath(filename))
    return f.startswith(_PLUMBING) or f == _COMMS or filename.startswith("<")


_PACKAGE = os.path.normcase(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


@functools.lru_cache(maxsize=4096)
def _in_microddp(filename: str) -> bool:
    return os.path.normcase(os.path.abspath(filename)).startswith(_PACKAGE)


def _name(f: FrameType) -> str:
    return f"{f.f_code.co_name} at {os.path.basename(f.f_code.co_filename)}:{f.f_lineno}"


def where(frame: FrameType | None, user: bool = False) -> str:
    """'func at file.py:LINE' for the innermost frame of `frame`'s stack that is not plumbing.

    With `user`, also name the innermost frame outside microddp when that is a different one:
    a DDP bucket's all-reduce is called from the reducer, inside the user's backward() call.
    """
    f = frame
    while f is not None and _is_plumbing(f.f_code.co_filename):
        f = f.f_back
    if f is None:  # nothing but plumbing: name the innermost frame anyway
        return _name(frame) if frame is not None else "no Python frame"
    if not user or not _in_microddp(f.f_code.co_filename):
        return _name(f)
    u = f.f_back
    while u is not None and (_is_plumbing(u.f_code.co_filename)
                             or _in_microddp(u.f_code.co_filename)):
        u = u.f_back
    return _name(f) + (f", under {_name(u)}" if u is not None else "")


def main_thread_where() -> str:
    """Where this process's main thread is right now (read from another thread)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    return where(frame)


def describe_tensor(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        dtype = str(x.dtype).removeprefix("torch.")
        return f"{dtype}[{','.join(map(str, x.shape))}]"
    if isinstance(x, (list, tuple)):
        inner = describe_tensor(x[0]) if x else ""
        return f"{len(x)}x{inner}" if inner else f"list of {len(x)}"
    return ""


@dataclass
class Entry:
    """One collective as this rank saw it. `done` is None while it is in flight."""

    seq: int
    group: str
    op: str
    shape: str
    detail: str  # reduce op, src/dst: what must match across ranks besides the shape
    caller: str
    started: float = field(default_factory=time.monotonic)
    done: float | None = None
    work: Any = None  # an async op's Work, polled by the watchdog
    escapable: bool = False  # the caller waits with the monitor's timeout and reports itself

    def fingerprint(self) -> dict:
        return {"op": self.op, "shape": self.shape, "detail": self.detail}

    def describe(self) -> str:
        what = " ".join(x for x in (self.shape, self.detail) if x)
        grp = "" if self.group == "world" else f" on group {self.group}"
        return f"{self.op} #{self.seq}{grp} ({what}) called from {self.caller}"

    def in_flight(self) -> bool:
        if self.done is not None:
            return False
        if self.work is not None and self.work.is_completed():
            self.done = time.monotonic()
            return False
        return True


class CollectiveLog:
    """The last `size` collectives of this rank and the ones still in flight; thread-safe."""

    def __init__(self, size: int = 64) -> None:
        self.recent: deque[Entry] = deque(maxlen=size)
        self.open: list[Entry] = []
        self._seq: dict[str, int] = {}
        self._lock = threading.Lock()

    def begin(self, group: str, op: str, shape: str, detail: str, caller: str) -> Entry:
        with self._lock:
            seq = self._seq.get(group, 0) + 1
            self._seq[group] = seq
            entry = Entry(seq, group, op, shape, detail, caller)
            self.recent.append(entry)
            self.open.append(entry)
            return entry

    def end(self, entry: Entry) -> None:
        entry.done = time.monotonic()
        with self._lock:
            if entry in self.open:
                self.open.remove(entry)

    def oldest_open(self) -> Entry | None:
        """The longest-waiting collective still in flight (completed async ones are dropped)."""
        with self._lock:
            self.open = [e for e in self.open if e.in_flight()]
            return self.open[0] if self.open else None

    def last_done(self) -> Entry | None:
        with self._lock:
            done = [e for e in self.recent if e.done is not None]
        return done[-1] if done else None
