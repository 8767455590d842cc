"""`init` and `shutdown` as users call them (`microddp.init`, `microddp.comms.init`): the
world (world/world.py) plus what microddp sets up on top of its process group.

When `init` forms the group, every rank is at the same point, so this is where the ranks of
this host agree on shared memory for the world's all-reduces (collectives/route.py; a store
exchange that would otherwise sit inside the first all-reduce, where a stall would escape
the hang monitor) and where the hang monitor starts (monitor/), so that a hang ends in a
report of where every rank is rather than in the backend's bare timeout. `shutdown` undoes
both, monitor first (its watchdog polls the store the group's end takes away), then leaves
the world. Both sit above the bootstrap, so they are imported here, directly.
"""

from __future__ import annotations

import atexit
from datetime import timedelta

import torch.distributed as dist

from ..collectives import route
from ..monitor import disable as stop_monitor
from ..monitor import enable as start_monitor
from ..monitor import stall_seconds, wanted
from ..world import world
from ..world.world import World


def init(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: float | timedelta | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    store: dist.Store | None = None,
    monitor: bool | None = None,
) -> World:
    """Join the job and return who we are (world.init says how ranks find each other).

    When this call forms the process group it also prepares shared memory and starts
    microddp.monitor; `monitor` False (or MICRODDP_MONITOR=0) leaves the monitor off.
    """
    monitor_on = wanted(monitor)  # a bad MICRODDP_MONITOR fails before any rendezvous
    joined, timeout_td = world.join(backend, init_method, timeout, rank=rank,
                                    world_size=world_size, store=store)
    if timeout_td is None:  # joined before, adopted, or a world of one: nothing to set up
        return joined
    route.prepare(None)
    if joined.backend == "gloo":
        # Registered after world's own: runs before it, so the monitor and shared memory go
        # too when a script never calls shutdown() (world.py says why gloo needs it).
        atexit.register(_leave_at_exit, joined)
    if monitor_on:
        start_monitor(timeout=stall_seconds(timeout_td.total_seconds()))
    return joined


def _leave_at_exit(joined: World) -> None:
    if world.is_initialized() and world.get_world() is joined:
        shutdown()


def get_world() -> World:
    """The World from `init`; if `init` was never called, `init()` (from RANK, WORLD_SIZE, or
    a world of one), as world.get_world does, with shared memory and the monitor set up."""
    if not world.is_initialized():
        init()
    return world.get_world()


def distributed(group=None) -> bool:
    """world.distributed, after forming the world with `init` if this process never did: a
    script that calls collectives (or builds a DDP) without `microddp.init()` gets the
    group's shared memory and the hang monitor too, as one that calls it does. A group torch
    does not know (given_group) answers for itself: no world is formed for it."""
    if not world.is_initialized() and not world.given_group(group):
        init()
    return world.distributed(group)


def shutdown() -> None:
    """Leave the job: stop the monitor (its thread joined), let go of shared memory (lanes
    joined, segments unmapped), then destroy the process groups (world.shutdown)."""
    stop_monitor()
    route.close()
    world.shutdown()
