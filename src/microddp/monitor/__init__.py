"""Find out what went wrong: hang and desync reports, replica drift.

    from microddp import monitor
    monitor.enable(timeout=60)          # log collectives; a stall gives one report of all ranks
    monitor.enable(timeout=60, debug=True)   # also compare every collective across ranks first
    monitor.check_replicas(model)       # the first parameter that differs between ranks

microddp.init() turns it on by default (see default.py); init(monitor=False) or
MICRODDP_MONITOR=0 leaves it off, and microddp.shutdown() stops it before the process group.

Logged: torch.distributed's collectives (so mdp.comms, DDP and user calls), mdp.comms'
shared-memory all-reduce (as all_reduce: collectives/route.py) and microddp's own
(microddp.collectives.ring_all_reduce, ...: called through the module, see patch.py).

A hang also leaves each rank's Flight Recorder dump (flight.py, for torch's torchfrtrace) in
the run folder, and a monitored job with a run folder keeps a live status file per rank there
(live.py, for `microddp status RUN`).

PyTorch's own tools for the same questions are TORCH_DISTRIBUTED_DEBUG=DETAIL (collective
fingerprints) and, on NCCL, the flight recorder; this package gives the same answers on any
backend, in one report a person can read.
"""

from __future__ import annotations

import atexit
import itertools
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import MicroDDPError
from ..world.store_client import python_store
from ..world.world import distributed, get_world
from . import patch
from .default import interrupt_pays, stall_seconds, wanted
from .drift import DriftCheck, check_replicas, checksum
from .flight import set_run_dir
from .hang import Monitor, format_report
from .live import set_step
from .log import note

__all__ = ["enable", "disable", "active", "check_replicas", "DriftCheck", "checksum",
           "Monitor", "format_report", "wanted", "stall_seconds", "note", "set_run_dir", "set_step"]

_generation = itertools.count()  # every rank enables the same number of times: fresh keys each
_exit_hook = False


def _seconds(timeout: float | timedelta) -> float:
    s = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if s <= 0:
        raise MicroDDPError(f"monitor timeout must be positive, got {timeout!r}")
    return s


def enable(timeout: float | timedelta = 60.0, debug: bool = False, store=None,
           answer_timeout: float = 5.0, log_size: int = 64,
           abort: bool = True, interrupt: bool | None = None) -> Monitor | None:
    """Start logging this rank's collectives; every rank must call it, after init().

    `timeout`: how long a collective may take before the ranks are asked where they are (keep
    it below the process group's own timeout). `debug`: compare op, shape and dtype of every
    collective across ranks before it runs (a few store round trips per call). `abort`: when
    a stalled rank cannot raise (NCCL, or a wait on a future), end it after the report instead
    of waiting for the process group's timeout. `interrupt`: wait on blocking gloo calls with
    `timeout`, so a stall raises the report in the caller long before the process group's
    timeout would end the wait; it costs a hand-over to gloo's thread per call (~0.1-0.2 ms on
    a small one), so by default (None) only when the group's timeout is more than
    REPORT_MARGIN_S beyond `timeout` (not for init()'s own monitor, which asks just before
    it). Returns None in a world of one process.
    """
    world = get_world()
    if not distributed():
        return None
    disable()
    if store is None:
        try:
            store = python_store(dist.distributed_c10d._get_default_store())
        except (AttributeError, RuntimeError, ValueError):
            raise MicroDDPError("no rendezvous store found; call microddp.init() first or "
                                "pass store=") from None
    timeout_s = _seconds(timeout)
    if interrupt is None:
        interrupt = interrupt_pays(timeout_s, _group_timeout_s())
    mon = Monitor(store, world.rank, world.world_size, timeout_s, debug,
                  f"microddp/monitor/{next(_generation)}/", answer_timeout, log_size, abort,
                  interrupt)
    patch.install(mon)
    global _exit_hook
    if not _exit_hook:
        # A script that never calls shutdown(): stop the watchdog while the interpreter is
        # whole. Left running into finalization, a daemon thread inside torch's C++ (a store
        # call) is ended by pthread_exit, which can abort the process ("terminate called
        # without an active exception").
        atexit.register(disable)
        _exit_hook = True
    return mon


def _group_timeout_s() -> float | None:
    """The default process group's timeout on gloo (what ends a blocking gloo call's wait);
    0 if the group has no gloo side (nothing to interrupt); None if torch does not say."""
    try:
        if dist.get_backend() == "nccl":
            return 0.0
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        return backend.options._timeout.total_seconds()  # torch's own field: no public getter
    except (AttributeError, RuntimeError, ValueError):
        return None


def disable() -> None:
    """Stop logging, restore torch.distributed's functions, and end the watchdog thread
    (joined: once this returns, the monitor touches neither torch nor the store)."""
    mon = patch.uninstall()
    if mon is not None:
        mon.close()


def active() -> Monitor | None:
    """The monitor watching this process's collectives, or None."""
    return patch.active()
