"""Setting up shared memory for one group through the rendezvous store, or deciding not to.

Every rank of the group runs `attach` at the same point (its first collective that could use
it). The ranks first exchange who they are (host identity, pid, the transport asked for with
MICRODDP_TRANSPORT), so that all of them take the same decision from the same facts: shared
memory only if every rank is on this host, by the host identity, never by LOCAL_WORLD_SIZE,
which says nothing about a sub-group and is wrong under a launcher that sets it per job. Then
group rank 0 creates the segment, the others map it, all of them say whether that worked, and
the segment is unlinked at once: from then on nothing is left in /dev/shm, whatever happens.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import timedelta

from ..errors import MicroDDPError
from . import segment as shm

ENV = "MICRODDP_TRANSPORT"
CHOICES = ("auto", "shm", "gloo")
_swept: list[str] | None = None  # what this process's first set-up swept away


def wanted() -> str:
    """MICRODDP_TRANSPORT: auto (the default), shm (shared memory or an error) or gloo."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise MicroDDPError(f"{ENV}={os.environ[ENV]!r} is not one of {', '.join(CHOICES)}; "
                            "unset it to let microddp choose shared memory on one host")
    return value


@dataclass
class Attached:
    """A group's segment once every rank has attached it, with the ranks' pids (to tell a dead peer)."""
    segment: shm.Segment
    pids: list[int]


def decide(who: list[dict]) -> tuple[bool, str]:
    """(use shared memory?, why not) from every rank's {"host", "want"}: the same answer on
    every rank. Forced shm on ranks that cannot share memory is an error."""
    wants = {w["want"] for w in who}
    hosts = {w["host"] for w in who}
    settings = {w.get("settings", "") for w in who}
    same = len(hosts) == 1 and "" not in hosts
    if "gloo" in wants:
        if "shm" in wants:
            raise MicroDDPError(f"{ENV} differs between ranks (shm on some, gloo on others); "
                                "set it alike on every rank")
        return False, f"{ENV}=gloo"
    if same and len(settings) > 1:
        raise MicroDDPError(f"the shared-memory settings differ between ranks ({sorted(settings)}): "
                            "set MICRODDP_SHM_* alike on every rank")
    if not same:
        why = ("the ranks are on different hosts" if "" not in hosts else
               "this host cannot run it (no /dev/shm, or a CPU not ordered like x86-64)")
        if "shm" in wants:
            raise MicroDDPError(f"{ENV}=shm, but {why}; unset it (or set auto) to use gloo "
                                "where shared memory cannot work")
        return False, why
    return True, ""


def attach(store, prefix: str, rank: int, size: int, nbytes: int, timeout_s: float,
           settings: str = "") -> Attached | None:
    """The group's segment of `nbytes`, mapped on this rank; None if the group uses gloo.
    Collective over the group's `size` ranks; `prefix` is unique to this group and set-up;
    `settings` must be the same on every rank (how the segment is used)."""
    global _swept
    mode = wanted()
    me = {"host": shm.host_identity() if mode != "gloo" and shm.supported() else "",
          "want": mode, "pid": os.getpid(), "settings": settings}
    who = _exchange(store, f"{prefix}/who", rank, size, json.dumps(me), timeout_s)
    use, _ = decide([json.loads(w) for w in who])
    if not use:
        return None
    segment, problem = None, ""
    if rank == 0:
        if _swept is None:
            _swept = shm.sweep()
        name = shm.segment_name()
        try:
            segment = shm.Segment(name, nbytes, create=True)
        except OSError as e:
            name, problem = "", f"cannot create {nbytes} bytes in {shm.SHM_DIR}: {e}"
        store.set(f"{prefix}/name", name)
    else:
        _wait(store, [f"{prefix}/name"], timeout_s)
        name = store.get(f"{prefix}/name").decode()
        if name:
            try:
                segment = shm.Segment(name, nbytes, create=False)
            except OSError as e:
                problem = f"cannot map {name}: {e}"
        else:
            problem = "group rank 0 could not create the segment"
    oks = _exchange(store, f"{prefix}/ok", rank, size, problem, timeout_s)
    if segment is not None and rank == 0:
        segment.unlink()  # every rank has mapped it (or given up): the name is not needed
    failed = [(r, p) for r, p in enumerate(oks) if p]
    if failed:
        if segment is not None:
            segment.close()
        if mode == "shm":
            r, why = failed[0]
            raise MicroDDPError(f"{ENV}=shm, but group rank {r} could not set up shared memory: "
                                f"{why}; unset it to use gloo")
        return None
    return Attached(segment, [json.loads(w)["pid"] for w in who])


def _exchange(store, key: str, rank: int, size: int, value: str, timeout_s: float) -> list[str]:
    """Every rank's `value`, by group rank."""
    store.set(f"{key}/{rank}", value)
    keys = [f"{key}/{r}" for r in range(size)]
    _wait(store, keys, timeout_s)
    return [store.get(k).decode() for k in keys]


def _wait(store, keys: list[str], timeout_s: float) -> None:
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise MicroDDPError(f"setting up shared memory: not every rank of the group arrived "
                            f"within {timeout_s:g} s ({str(e).splitlines()[0]}); every rank must "
                            "call the same collectives in the same order") from None
