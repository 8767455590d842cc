"""When a collective stalls, ask every rank where it is (through the store) and say it once.

The store is the rendezvous TCPStore every rank already talks to; it keeps working when the
process group is stuck. The first rank to notice a stall becomes the reporter: it raises a flag,
every rank that can still answer writes a status (its open collective, or the Python line its
main thread is on), and the reporter turns them into one report, grouped by what ranks do.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from datetime import timedelta
from typing import Any

from . import flight, live
from .log import CollectiveLog, Entry, main_thread_where

POLL_S = 0.1  # at a few ranks; more ranks poll the shared store less often (see Monitor)
MAX_POLL_S = 1.0
HEAD = "microddp hang report:"


class Monitor:
    """Per-process monitoring state: the log, the store, the watchdog thread."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout_s: float,
                 debug: bool, prefix: str, answer_s: float, log_size: int = 64,
                 abort: bool = True, interrupt: bool = True) -> None:
        self.abort, self.interrupt = abort, interrupt
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout_s, self.debug, self.prefix = timeout_s, debug, prefix
        # Every rank polls the one store: keep the total near 100 requests a second. A long
        # threshold needs no quick look (a twentieth of it, up to 1 s): each poll wakes this
        # thread and the store's and takes the GIL, which on a loaded machine measurably slows
        # small collectives (docs/07-observability.md).
        self.poll_s = max(POLL_S, world_size / 100, min(timeout_s / 20, MAX_POLL_S))
        self.answer_s = max(answer_s, 3 * self.poll_s)
        self.log = CollectiveLog(log_size)
        self.report: str | None = None
        self.dumped: list = []  # the Flight Recorder dumps this rank wrote (flight.py)
        self._answered = False
        self._beaten = -1e9
        self._stalled: Entry | None = None
        self._report_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="microddp-monitor", daemon=True)
        self._thread.start()

    def key(self, *parts: object) -> str:
        """This rank's store key for `parts`, under the monitor's prefix."""
        return self.prefix + "/".join(map(str, parts))

    def close(self) -> None:
        """Stop the watchdog and wait for it: after this, it calls neither torch nor the store
        (shutdown destroys the process group next; at exit the interpreter tears down)."""
        self._stop.set()
        if self._thread is threading.current_thread():
            return
        # Between two polls it sees the flag at once; in the middle of a report it may wait
        # for the other ranks' answers first (answer_s, twice at most).
        self._thread.join(timeout=2 * self.answer_s + 5)
        if self._thread.is_alive():
            print(f"[rank {self.rank}] microddp monitor: the watchdog thread did not stop "
                  "within its time (a store call hangs?); the process goes on without it",
                  file=sys.stderr, flush=True)

    # -- what this rank says about itself --------------------------------------------------
    def status(self) -> dict:
        # The collective this rank gave up on counts as open even though its Work has failed.
        """What this rank is doing now: its oldest open collective, the line it is on, its last
        finished one."""
        entry = self._stalled or self.log.oldest_open()
        last = self.log.last_done()
        return {
            "rank": self.rank,
            "in": entry.describe() if entry is not None else None,
            "where": main_thread_where(),
            "last": f"{last.op} #{last.seq}" if last is not None else None,
        }

    def _answer(self) -> None:
        if not self._answered:
            self._answered = True
            self._dump()
            self.store.set(self.key("status", self.rank), json.dumps(self.status()))

    def _dump(self) -> None:
        """Write this rank's Flight Recorder dump into the folder the reporter chose. A dump
        that cannot be written costs a line on stderr, never the report."""
        try:
            folder = self.store.get(self.key("fr_dir")).decode()
            self.dumped = flight.write(self.log.entries(), self.rank, self.timeout_s, folder)
        except Exception as e:  # noqa: BLE001 (a full disk, a read-only folder: say it, go on)
            print(f"[rank {self.rank}] microddp monitor: no Flight Recorder dump ({e})",
                  file=sys.stderr, flush=True)

    def _claim_folder(self) -> None:
        """Name the dumps' folder for every rank, before raising the flag (the first to
        claim wins if two ranks notice the stall at once)."""
        key = self.key("fr_dir")
        try:
            self.store.compare_set(key, "", flight.choose_folder())
        except (AttributeError, RuntimeError):  # a store without compare_set
            if not self.store.check([key]):
                self.store.set(key, flight.choose_folder())

    # -- the watchdog: notice stalls (async ops, NCCL) and answer other ranks' requests -------
    def _beat(self) -> None:
        """Rewrite this rank's status file (live.py) if the job has a run folder."""
        folder = flight.run_dir()
        now = time.monotonic()
        if folder is None or now - self._beaten < live.EVERY_S:
            return
        self._beaten = now
        try:
            live.write(folder, live.snapshot(self.rank, self.world_size, self.log))
        except OSError:  # a full disk or a read-only folder: the live view goes stale, no more
            pass

    def _watch(self) -> None:
        failures = 0
        while not self._stop.wait(self.poll_s):
            self._beat()
            try:
                if not self._answered and self.store.check([self.key("request")]):
                    self._answer()
                entry = self.log.oldest_open()
                # A caller waiting with the monitor's timeout (interrupt) raises the report
                # itself; the watchdog speaks for every other wait.
                limit = self.timeout_s * (2 if entry is not None and entry.escapable else 1)
                if entry is not None and time.monotonic() - entry.started > limit:
                    if self._stop.is_set():
                        return  # shutdown began: no new store traffic
                    text = self.collect(entry)
                    print(f"[rank {self.rank}] {text}", file=sys.stderr, flush=True)
                    # A blocking gloo call ends at the process group's timeout, in a
                    # MicroDDPError with this report: a Python exception, which unwinds and
                    # cleans up as os._exit does not.
                    if self.abort and not entry.ends_itself:
                        self._abort(entry)
                    return
                failures = 0
            except Exception:  # noqa: BLE001 (store gone at shutdown: nothing left to watch)
                failures += 1
                if self._stop.is_set() or failures > 20:
                    return

    def _abort(self, entry: Entry) -> None:
        """The main thread is blocked where Python cannot reach it: end the process, as
        PyTorch's NCCL watchdog does, rather than wait out the process group's timeout."""
        if self._stop.wait(self.answer_s) or not entry.in_flight():
            return  # it finished (or raised) after all
        print(f"[rank {self.rank}] microddp monitor: ending this process (exit code 1) after "
              "the hang report; pass abort=False to monitor.enable to keep waiting",
              file=sys.stderr, flush=True)
        os._exit(1)

    # -- the report -----------------------------------------------------------------------
    def collect(self, stalled: Entry | None, why: str = "", own: bool = True) -> str:
        """Raise the flag, gather every rank's status, build (or fetch) the one report. `own`:
        the monitor's threshold ran out (False: the backend gave up first, `why` says how)."""
        with self._report_lock:
            if self.report is not None:
                return self.report
            self._stalled = stalled
            self._claim_folder()
            first = self.store.add(self.key("request"), 1) == 1
            self._answer()
            if first:
                waited = self._waited(stalled) if own else None
                statuses = self._statuses()
                self.report = format_report(self.rank, stalled, statuses, self.world_size,
                                            waited, why, self._dump_folder())
                self.store.set(self.key("report"), self.report)
            else:
                self.report = self._fetch_report()
            return self.report

    def _waited(self, stalled: Entry | None) -> float:
        """The seconds the report's head names: the monitor's threshold, unless the wait
        ended before it (the group's own, shorter timeout ran out first: a gloo recv, a
        shared-memory wait), then the time it really waited."""
        if stalled is None:
            return self.timeout_s
        waited = time.monotonic() - stalled.started
        return self.timeout_s if waited >= self.timeout_s else round(waited, 1)

    def _dump_folder(self) -> str | None:
        return str(self.dumped[0].parent) if self.dumped else None

    def _statuses(self) -> dict[int, dict]:
        keys = {r: self.key("status", r) for r in range(self.world_size)}
        try:  # usually everyone answers within a poll or two
            self.store.wait(list(keys.values()), timedelta(seconds=self.answer_s))
        except Exception:  # noqa: BLE001 (a store timeout: some rank is silent; take the rest)
            pass
        return {r: json.loads(self.store.get(k)) for r, k in keys.items()
                if self.store.check([k])}

    def _fetch_report(self) -> str:
        try:
            self.store.wait([self.key("report")], timedelta(seconds=self.answer_s + 2))
            return self.store.get(self.key("report")).decode()
        except Exception:  # noqa: BLE001 (the reporter itself died; say what we know)
            return format_report(self.rank, self.log.oldest_open(), {self.rank: self.status()},
                                 self.world_size, self.timeout_s, "")


def _ranks(rs: list[int]) -> str:
    return ("rank " if len(rs) == 1 else "ranks ") + ",".join(map(str, rs))


def format_report(rank: int, stalled: Entry | None, statuses: dict[int, dict],
                  world_size: int, timeout_s: float | None, why: str,
                  dumps: str | None = None) -> str:
    """One paragraph: which ranks are where, grouped; ranks that did not answer named too.
    `timeout_s`: the monitor's threshold, when that is what ran out; None when the backend
    gave up first (its own timeout, which `why` gives in its words)."""
    why = re.sub(r"^\[[^\]]*\]\s*", "", why)  # drop gloo's "[path/file.cc:553]" prefix
    timed_out = not why or "timed out" in why.lower() or "timeout" in why.lower()
    call = "a collective" if stalled is None else f"collective {stalled.op} #{stalled.seq}"
    if timed_out and timeout_s is not None:
        head = f"{call} on rank {rank} did not complete within {timeout_s:g} s"
    elif timed_out:
        head = f"{call} on rank {rank} timed out"
    else:
        head = f"{call} on rank {rank} failed"
    groups: dict[str, list[int]] = {}
    for r, st in sorted(statuses.items()):
        if st["in"] is not None:
            line = f"in {st['in']}"
        else:
            last = f"; last collective {st['last']}" if st["last"] else "; no collective yet"
            line = f"in {st['where']} (not in a collective{last})"
        groups.setdefault(line, []).append(r)
    lines = [f"{HEAD} {head}" + (f" ({why})" if why else "")]
    for line, rs in groups.items():
        verb = "is" if len(rs) == 1 else "are"
        lines.append(f"  {_ranks(rs)} {verb} {line}")
    silent = [r for r in range(world_size) if r not in statuses]
    if silent:
        lines.append(f"  {_ranks(silent)} did not answer (exited, crashed, or frozen outside "
                     "Python)")
    if dumps:
        lines.append(f"  Flight Recorder dumps in {dumps} (read them with: torchfrtrace {dumps})")
    lines.append("fix: every rank must call the same collectives in the same order; look at "
                 "the rank that is elsewhere")
    return "\n".join(lines)


_LEAD = re.compile(r"\[rank ?\d+\]:? ?")  # torch's "[rank0]: " or the watchdog's "[rank 0] "


def find_report(lines: list[str]) -> list[str]:
    """The last hang report in a process's output, as the lines format_report made.

    It may be the message of an uncaught MicroDDPError (after a traceback, each line prefixed
    by torch with "[rank0]: ") or the watchdog's print (prefixed on its first line only).
    Returns [] if there is none.
    """
    found: list[str] = []
    for i, line in enumerate(lines):
        at = line.find(HEAD)
        if at < 0:
            continue
        m = _LEAD.match(line)
        lead = m.group(0) if m else ""
        found = [line[at:]]
        for nxt in lines[i + 1:]:
            body = nxt[len(lead):] if lead and nxt.startswith(lead) else nxt
            if not body.startswith(("  ", "fix:")):
                break
            found.append(body)
            if body.startswith("fix:"):
                break
    return found
