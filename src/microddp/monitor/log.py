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
from types import CodeType, FrameType
from typing import Any

import torch

_monotonic = time.monotonic

_PLUMBING = tuple(os.path.normcase(os.path.abspath(p)) + os.sep for p in {
    os.path.dirname(torch.__file__),
    os.path.dirname(__file__),
    sysconfig.get_paths()["stdlib"],
})
# comms' typed wrappers, the handle of an async call, and the glue a failed wait goes through
# to the monitor (comms' Handle and DDP's buckets call patch.failed_wait): where a wait sits,
# never worth naming
_ROOT = os.path.dirname(os.path.dirname(__file__))
_COMMS = {os.path.normcase(os.path.join(_ROOT, "comms", f))
          for f in ("ops.py", "handle.py", "session.py")}


@functools.lru_cache(maxsize=4096)  # once per function (see _kind), and by tests
def _is_plumbing(filename: str) -> bool:
    f = os.path.normcase(os.path.abspath(filename))
    return f.startswith(_PLUMBING) or f in _COMMS or filename.startswith("<")


_PACKAGE = os.path.normcase(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


@functools.lru_cache(maxsize=4096)
def _in_microddp(filename: str) -> bool:
    return os.path.normcase(os.path.abspath(filename)).startswith(_PACKAGE)


_USER, _OURS, _PLUMBING_KIND = 0, 1, 2
_kinds: dict[CodeType, int] = {}  # per function: one dict lookup per frame of a walk


def _kind(code: CodeType) -> int:
    k = _kinds.get(code)
    if k is None:
        if len(_kinds) > 65536:  # code made on the fly (exec) without end: start afresh
            _kinds.clear()
        name = code.co_filename
        k = _kinds[code] = (_PLUMBING_KIND if _is_plumbing(name) else
                            _OURS if _in_microddp(name) else _USER)
    return k


Location = tuple  # ((code, line), ...): the frames where() names, not yet put in words


def locate(frame: FrameType | None, user: bool = False) -> Location:
    """The frames where() names, as (code, line) pairs: cheap enough to take on every call
    (an async call's caller moves on), put in words only when a report asks."""
    # This runs as every collective ends: a known frame costs one dict lookup, and no call
    # is made for it (each Python call costs about a microsecond on a loaded machine).
    f, kinds = frame, _kinds
    k = _PLUMBING_KIND
    while f is not None:
        k = kinds.get(f.f_code)
        if k is None:
            k = _kind(f.f_code)
        if k != _PLUMBING_KIND:
            break
        f = f.f_back
    if f is None:  # nothing but plumbing: name the innermost frame anyway
        return ((frame.f_code, frame.f_lineno),) if frame is not None else ()
    here = (f.f_code, f.f_lineno)
    if not user or k != _OURS:
        return (here,)
    u = f.f_back
    while u is not None and (kinds.get(u.f_code) or _kind(u.f_code)) != _USER:
        u = u.f_back
    return (here,) if u is None else (here, (u.f_code, u.f_lineno))


def name_location(location: Location) -> str:
    """'func at file.py:LINE', then ', under func at file.py:LINE' for the user's frame."""
    if not location:
        return "no Python frame"
    names = [f"{code.co_name} at {os.path.basename(code.co_filename)}:{line}"
             for code, line in location]
    return names[0] + "".join(f", under {n}" for n in names[1:])


def where(frame: FrameType | None, user: bool = False) -> str:
    """'func at file.py:LINE' for the innermost frame of `frame`'s stack that is not plumbing.

    With `user`, also name the innermost frame outside microddp when that is a different one:
    a DDP bucket's all-reduce is called from the reducer, inside the user's backward() call.
    """
    return name_location(locate(frame, user))


# The code of the monitor's wrappers (patch.py adds it): where `Entry._frame_now` stops.
WRAPPER_CODES: set[CodeType] = set()

_doing: list = [None]  # what the main thread does beside collectives (see note)


def note(what: object) -> None:
    """Say what the main thread is doing now, for a hang report to name with its line (a
    pipeline's schedule action: it waits in a recv, which is no collective); None: nothing.
    Costs one assignment; `what` is put in words only when a report asks."""
    _doing[0] = what


def main_thread_where() -> str:
    """Where this process's main thread is right now (read from another thread), and what it
    is doing if a note says (see note)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    what = _doing[0]
    return where(frame) + (f" during {what}" if what is not None else "")


def describe_tensor(x: Any) -> str:
    """A tensor's dtype and shape (`float32[4,8]`), or a list's length and first element's."""
    if isinstance(x, torch.Tensor):
        dtype = str(x.dtype).removeprefix("torch.")
        return f"{dtype}[{','.join(map(str, x.shape))}]"
    if isinstance(x, (list, tuple)):
        inner = describe_tensor(x[0]) if x else ""
        return f"{len(x)}x{inner}" if inner else f"list of {len(x)}"
    return ""


class Entry:
    """One collective as this rank saw it. `done` is None while it is in flight.

    What the call was (shape, detail) and which line made it (caller) are worked out when first
    asked, from the call's arguments and its caller's frame: a report only asks about calls in
    flight, and the default monitor must cost next to nothing per call. The entry holds those
    arguments and that frame only while the call is in flight, so it keeps no tensor (nor the
    caller's locals) alive after; asked later, what was never worked out reads as "".
    `settle()` works everything out at once (debug mode compares it across ranks before the
    call; tests and tools read the log after it).
    """

    __slots__ = ("seq", "group", "op", "started", "done", "failed", "work", "escapable",
                 "ends_itself", "record", "ends", "collective_seq", "_sketch", "_shape",
                 "_detail", "_caller", "_location", "_call", "_frame", "_thread")

    def __init__(self, seq: int, group: str, op: str, call: tuple | None = None,
                 frame: FrameType | None = None, record: int = 0) -> None:
        self.seq, self.group, self.op = seq, group, op
        self.record = record  # this rank's count of logged calls over all groups (record_id)
        self.started = _monotonic()
        self.done: float | None = None
        self.failed = False  # its async Work completed with an error (see in_flight)
        self.work: Any = None  # an async op's Work, polled by the watchdog
        # The caller waits with the monitor's timeout and reports itself (monitor interrupt).
        self.escapable = False
        # The backend ends this wait on its own at the process group's timeout (a blocking
        # gloo call): after the report, the watchdog leaves the ending to it.
        self.ends_itself = False
        # A point-to-point message's (source, destination, tag, its number among the messages
        # from that source to that destination with that tag), global ranks; None: a collective.
        self.ends: tuple[int, int, int, int] | None = None
        self.collective_seq = 0  # a message's: its group's collectives logged before it
        self._sketch: tuple | None = None  # (count or None, dtype, shape) kept as a call ends
        self._shape: str | None = None
        self._detail: str | None = None
        self._caller: str | None = None
        self._location: Location | None = None
        # (describe(args, kwargs) -> (shape, detail), args, kwargs[, pick(args, kwargs) ->
        # the tensor or list that describe names])
        self._call = call
        self._frame = frame  # the caller's frame, while the call runs
        # Or, for a blocking call that did not take its caller's frame (a frame object made
        # on every call costs more than a small shared-memory all-reduce's own work), the
        # thread it runs on: its frame is found there while the call runs (`_frame_now`).
        self._thread: int | None = None

    @property
    def shape(self) -> str:  # e.g. "float32[4]"
        """The dtype and shape of the call's tensor, e.g. `float32[4]`."""
        self._describe_call()
        return self._shape

    @property
    def detail(self) -> str:  # reduce op, src/dst: what must match across ranks besides the shape
        """What else must match across ranks besides the shape: reduce op, source, destination."""
        self._describe_call()
        return self._detail

    @property
    def caller(self) -> str:
        """The user's file and line that made the call (found once, when first asked)."""
        if self._caller is None:
            if self._location is None:
                frame = self._frame  # one read: the calling thread may let go of it meanwhile
                if frame is None:
                    frame = self._frame_now()
                if frame is None:
                    return ""
                self._location = locate(frame, user=True)
            self._caller = name_location(self._location)
        return self._caller

    def _describe_call(self) -> None:
        if self._shape is not None:
            return  # described already
        call = self._call  # one read: the calling thread may let go of it meanwhile
        if call is None and self._sketch is not None:  # ended: its sketch says the shape
            count, dtype, shape = self._sketch
            inner = f"{str(dtype).removeprefix('torch.')}[{','.join(map(str, shape))}]"
            self._shape, self._detail = (inner if count is None else f"{count}x{inner}"), ""
            return
        self._shape, self._detail = call[0](call[1], call[2]) if call is not None else ("", "")

    def sketch(self) -> None:
        """Keep the dtype and shape of the call's tensor as raw values (a dump names them
        later; formatting them now would cost the call's caller)."""
        call = self._call
        if call is None or len(call) < 4 or self._shape is not None:
            return
        x = call[3](call[1], call[2])
        if isinstance(x, torch.Tensor):
            self._sketch = (None, x.dtype, tuple(x.shape))
        elif isinstance(x, (list, tuple)) and x and isinstance(x[0], torch.Tensor):
            self._sketch = (len(x), x[0].dtype, tuple(x[0].shape))

    def locate_caller(self) -> None:
        """Note the caller's line now (in words later): an async call's caller moves on."""
        frame = self._frame
        if frame is not None and self._location is None:
            self._location = locate(frame, user=True)
        self._frame = None

    def location(self) -> Location:
        """The caller's frames (see locate), if they were noted; () if not."""
        if self._location is None and self._frame is not None:
            self.locate_caller()
        if self._location is None:
            frame = self._frame_now()
            if frame is not None:
                self._location = locate(frame, user=True)
        return self._location or ()

    def _frame_now(self) -> FrameType | None:
        """The caller's frame of a call still running on thread `_thread` (see __init__):
        the frame below the monitor's wrapper on that thread's stack, or None."""
        tid = self._thread
        if tid is None or self.done is not None:
            return None
        f = sys._current_frames().get(tid)
        while f is not None and f.f_code not in WRAPPER_CODES:
            f = f.f_back
        return f.f_back if f is not None else None

    def settle(self) -> None:
        """Work out shape, detail and caller now, and let go of the call's arguments."""
        self.locate_caller()
        _ = self.caller
        self._describe_call()
        self._call = None

    def release(self) -> None:
        """The call is over: drop what kept its tensors, its Work and its caller alive."""
        self._call = self._frame = self.work = None

    def fingerprint(self) -> dict:
        """What two ranks' calls must agree on: operation, shape and detail."""
        return {"op": self.op, "shape": self.shape, "detail": self.detail}

    def describe(self) -> str:
        """One line for a report: operation, sequence number, group, shape and calling line."""
        what = " ".join(x for x in (self.shape, self.detail) if x)
        grp = "" if self.group == "world" else f" on group {self.group}"
        return f"{self.op} #{self.seq}{grp} ({what}) called from {self.caller or 'an unknown line'}"

    def in_flight(self) -> bool:
        """Whether the call is still open (not ended and its work not completed)."""
        if self.done is not None:
            return False
        work = self.work
        if work is not None and work.is_completed():
            # Finished, or failed (then a report may still describe it): say what it was
            # before letting go of its tensors.
            self._describe_call()
            self.failed = _failed(work)
            self.done = time.monotonic()
            self.release()
            return False
        return True


def _failed(work: Any) -> bool:
    """Whether a completed Work is known to have ended in an error: gloo's future and a
    shared-memory call's hold it (Work.exception() and is_success() are deprecated in torch
    and warn). False where that is unknown: a Work without a future, or NCCL's, whose future
    completes at launch and never carries the error (a failed wait is then placed by the
    calls still in flight, as before)."""
    try:
        fut = work.get_future()
    except Exception:  # noqa: BLE001 (a backend without futures: unknown)
        return False
    try:
        fut.value()
    except Exception:  # noqa: BLE001 (the error the work failed with, whatever its type)
        return True
    return False


class CollectiveLog:
    """The last `size` collectives of this rank and the ones still in flight; thread-safe."""

    def __init__(self, size: int = 64) -> None:
        self.recent: deque[Entry] = deque(maxlen=size)
        self.open: dict[Entry, None] = {}  # in call order; a dict: ending one is O(1)
        # Point-to-point messages (a pipeline's, a parameter server's), in a ring of their own:
        # a pipeline step's many messages must not push the collectives out of a dump, and
        # they stay out of `open`, so hang reports keep naming collectives (a pipeline's wait
        # in a receive is named by its note).
        self.messages: deque[Entry] = deque(maxlen=size)
        self._size = size
        self._seq: dict[str, int] = {}
        self._p2p_seq: dict[str, int] = {}
        self._channels: dict[tuple, int] = {}
        self._records = 0
        self._lock = threading.Lock()

    def begin(self, group: str, op: str, call: tuple | None = None,
              frame: FrameType | None = None) -> Entry:
        """Record that a collective started on `group`; the entry to `end` when it finishes."""
        with self._lock:
            seq = self._seq[group] = self._seq.get(group, 0) + 1
            entry = Entry(seq, group, op, call, frame, self._records)
            self._records += 1
            self.recent.append(entry)
            self.open[entry] = None
            if len(self.open) > self._size:
                # Many async calls between two polls of the watchdog: drop the finished ones
                # here, so that the log stays short and lets go of their tensors.
                self._drop_finished()
            return entry

    def begin_message(self, group: str, op: str, src: int, dst: int, tag: int,
                      tensor: torch.Tensor, frame: FrameType | None = None) -> Entry:
        """Record that a send or receive (`op`) of `tensor` from global rank `src` to `dst`
        with `tag` started on `group`; the entry to `end` when it is done. Numbered apart from
        the collectives, as torch's Flight Recorder numbers them (p2p_seq_id), and within its
        channel (src, dst, tag), whose messages arrive in the order they were sent."""
        with self._lock:
            seq = self._p2p_seq.get(group, 0) + 1
            self._p2p_seq[group] = seq
            channel = (group, src, dst, tag)
            nth = self._channels[channel] = self._channels.get(channel, 0) + 1
            entry = Entry(seq, group, op, None, frame, self._records)
            entry.ends, entry.collective_seq = (src, dst, tag, nth), self._seq.get(group, 0)
            entry._sketch = (None, tensor.dtype, tuple(tensor.shape))
            self._records += 1
            self.messages.append(entry)
            return entry

    def end(self, entry: Entry) -> None:
        """Record that the collective of `entry` finished, and let go of its tensors (after
        noting what it was and where it came from, for a Flight Recorder dump: flight.py)."""
        if entry.done is None:  # (a dump may have seen an async message done already)
            entry.done = _monotonic()
        # locate_caller(), sketch() and release() written out: this runs on every collective,
        # and each Python call costs about a microsecond on a loaded machine
        frame = entry._frame
        if frame is not None and entry._location is None:
            entry._location = locate(frame, user=True)
        call = entry._call
        if call is not None and entry._shape is None and len(call) > 3:
            x = call[3](call[1], call[2])
            if isinstance(x, torch.Tensor):
                entry._sketch = (None, x.dtype, tuple(x.shape))
            elif isinstance(x, (list, tuple)) and x and isinstance(x[0], torch.Tensor):
                entry._sketch = (len(x), x[0].dtype, tuple(x[0].shape))
        entry._call = entry._frame = entry.work = None
        self.open.pop(entry, None)  # one step under the GIL (identity hash): no lock needed

    def _drop_finished(self) -> None:
        for e in list(self.open):  # in place: a concurrent end() must not be undone
            if not e.in_flight():
                self.open.pop(e, None)

    def entries(self) -> list[Entry]:
        """The recent calls and messages and every call still open, in call order (a dump's
        ring buffer)."""
        with self._lock:
            both = {e: None for e in self.recent}
            both.update(self.open)
            both.update(dict.fromkeys(self.messages))
        for e in self.messages:
            e.in_flight()  # an async message done but never waited for: completed now
        return sorted(both, key=lambda e: e.record)

    def oldest_open(self) -> Entry | None:
        """The longest-waiting collective still in flight (completed async ones are dropped)."""
        with self._lock:
            self._drop_finished()
            return next(iter(self.open), None)

    def oldest_failed(self) -> Entry | None:
        """The earliest recent async collective whose Work failed, or None: what a failed wait
        was waiting for, once it has left the calls in flight."""
        with self._lock:
            self._drop_finished()
            return next((e for e in self.recent if e.failed), None)

    def last_done(self) -> Entry | None:
        """The most recent collective that finished, or None."""
        with self._lock:
            done = [e for e in self.recent if e.done is not None]
        return done[-1] if done else None
