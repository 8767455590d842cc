"""Joining and leaving the world: `init`, `shutdown`, and the `World` record.

`init` accepts every way PyTorch processes find each other (torchrun's environment, `env://`,
`tcp://host:port`, `file://path`, a ready `Store`) and a world of one process that needs no
process group at all.

This is the bootstrap every layer stands on, and nothing more: the process group. What
microddp sets up above it once a group forms (the shared-memory route of every all-reduce,
the hang monitor) is comms/session.py's, whose `init` and `shutdown` are the ones users call
(`microddp.init`, `microddp.comms.init`): they call `join` and `shutdown` here.
"""

from __future__ import annotations

import atexit
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import MicroDDPError
from .hosts import choose_interface, is_loopback
from .preflight import preflight
from .rendezvous import env_int, master_addr, store_args
from .slurm import from_slurm
from .teardown import before_group, release, watch

# Much shorter than PyTorch's 30 minutes: a stuck collective should surface while someone is
# still watching. Override with init(timeout=...) or MICRODDP_TIMEOUT (seconds).
DEFAULT_TIMEOUT_S = 120.0
BACKENDS = ("gloo", "nccl", "mpi", "ucc")


@dataclass(frozen=True)
class World:
    """Who this process is in the job, and where its tensors live."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None for a world of one process (no process group)

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0, the one that prints and saves."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """Whether a process group was formed (False for a world of one process)."""
        return self.backend is not None


_world: World | None = None


def distributed(group=None) -> bool:
    """Is there a process group to talk through? The one place microddp asks "is this a world
    of one?"; every other module calls this (tests/test_layout.py checks that).

    False in a world of one process, where every collective is a local no-op or copy, and
    False once torch's default group is gone behind microddp's back (a script that called
    `dist.destroy_process_group()` itself, as torch's DDP examples do): then there is nothing
    to talk through, and a DDP built afterwards must act alone rather than fail.

    With `group`, also "does `group` hold more than one rank?": False for a group of one (or
    one this rank is not in: torch gives its size as -1), where a reduction is the identity.
    Without `group` the size is not asked: a one-rank world formed through a store
    (`init(world_size=1, init_method=...)`) still talks through its group, as in torch.
    """
    if not (get_world().distributed and dist.is_initialized()):
        return False
    return group is None or dist.get_world_size(group) > 1


def group_size(group=None) -> int:
    """How many ranks `group` holds (the whole world when None); 1 in a world of one.
    -1 if this rank is not in `group` (torch's answer)."""
    return dist.get_world_size(group) if distributed() else 1


def group_rank(group=None) -> int:
    """This process's rank inside `group` (-1 if it is not a member); 0 in a world of one."""
    return dist.get_rank(group) if distributed() else 0


def group_timeout(group=None) -> timedelta:
    """How long `group`'s backend waits before a blocked call fails (default: the world's,
    init's `timeout`). Sub-groups ask for it: torch gives a new group its own default
    (30 minutes on gloo), not the world's, so a lost host would stall them that long."""
    try:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        return pg._get_backend(torch.device("cpu")).options._timeout  # torch's own field
    except (AttributeError, RuntimeError, ValueError):  # private API, or no CPU side
        return dist.default_pg_timeout


MAX_TIMEOUT_S = 10 * 365 * 86400  # "never" for a job; a timedelta overflows far beyond it


def _as_timedelta(timeout: float | timedelta | None) -> timedelta:
    """`timeout` (seconds, a timedelta, or None for MICRODDP_TIMEOUT or the default), checked:
    a string, a bool, nan, inf or a value <= 0 is one clear line, not a deep TypeError."""
    what = "timeout"
    if timeout is None:
        what, text = "MICRODDP_TIMEOUT", os.environ.get("MICRODDP_TIMEOUT")
        try:
            timeout = DEFAULT_TIMEOUT_S if text is None else float(text)
        except ValueError:
            raise MicroDDPError(f"MICRODDP_TIMEOUT must be a number of seconds, got "
                                f"{text!r}") from None
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise MicroDDPError(f"{what} must be a number of seconds, got {timeout!r}")
    if not 0 < timeout <= MAX_TIMEOUT_S:
        raise MicroDDPError(f"{what} must be a positive number of seconds up to "
                            f"{MAX_TIMEOUT_S} (ten years), got {timeout!r}")
    return timedelta(seconds=float(timeout))


def backend_available(name: str) -> bool:
    """Whether this torch build and machine can run backend `name`."""
    checks = {
        "gloo": dist.is_gloo_available,
        "nccl": lambda: dist.is_nccl_available() and torch.cuda.is_available(),
        "mpi": dist.is_mpi_available,
        "ucc": lambda: getattr(dist, "is_ucc_available", lambda: False)(),
    }
    return name in checks and bool(checks[name]())


def uses_nccl(group=None) -> bool:
    """Whether CUDA tensors on `group` travel through NCCL: its backend is nccl, torch's
    per-device "cpu:gloo,cuda:nccl", or "undefined" (what init_process_group() without a
    backend gives since torch 2.6: gloo for CPU tensors, NCCL for CUDA ones, chosen lazily)."""
    name = str(dist.get_backend(group))
    if name == "undefined":
        return dist.is_nccl_available() and torch.cuda.is_available()
    return "nccl" in name


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_backend(backend: str | None, local_rank: int,
                   local_world_size: int | None = None) -> str:
    """NCCL when every rank of this host has a GPU of its own, gloo otherwise; validate an
    explicit choice. All ranks must choose alike (a group that is NCCL on some ranks and gloo
    on others never works), so the test is the host's count of ranks (LOCAL_WORLD_SIZE), not
    this rank's number: with 4 ranks on 2 GPUs, every rank takes gloo. torchrun and `microddp
    run` set LOCAL_WORLD_SIZE; without it only this rank's LOCAL_RANK can be tested (the world
    size is no bound: it spans hosts), so a launcher that omits it must give a GPU per rank."""
    if backend is None:
        needed = local_rank + 1 if local_world_size is None else local_world_size
        return "nccl" if dist.is_nccl_available() and needed <= _gpus() else "gloo"
    backend = backend.lower()
    if backend not in BACKENDS:
        raise MicroDDPError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if not backend_available(backend):
        hint = "gloo runs on any CPU" if backend != "gloo" else "reinstall torch"
        why = "no CUDA GPU is usable here" if backend == "nccl" else "this torch build lacks it"
        raise MicroDDPError(f"backend {backend!r} is not available: {why}; {hint}")
    return backend


def choose_device(backend: str | None, local_rank: int) -> torch.device:
    """One GPU per local rank under NCCL (made the current device before any CUDA tensor
    is), and in a world of one (`backend` None) that has one; the CPU otherwise."""
    if backend is None:
        # No set_device: with no process group nothing relies on the current device, and
        # asking who we are (get_world) must not start CUDA in a process that never uses it.
        return torch.device("cuda", local_rank) if local_rank < _gpus() else torch.device("cpu")
    if backend == "nccl":
        if local_rank >= _gpus():
            raise MicroDDPError(
                f"LOCAL_RANK {local_rank} has no GPU: only {_gpus()} visible; "
                "start at most one process per GPU"
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: float | timedelta | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    store: dist.Store | None = None,
) -> World:
    """Join the job and return who we are: the process group alone (`microddp.init`, which is
    comms.init, also sets up shared memory and the hang monitor on top of it).

    Rank and world size come from the arguments, else from RANK / WORLD_SIZE (torchrun,
    `microddp run`), else this is a world of one process, which needs no process group.
    """
    return join(backend, init_method, timeout, rank=rank, world_size=world_size,
                store=store)[0]


def join(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: float | timedelta | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    store: dist.Store | None = None,
) -> tuple[World, timedelta | None]:
    """`init`'s work, and the group's timeout if this call formed the process group (None if
    the world was already joined, adopted from the script's own group, or of one process):
    the moment comms.init sets up what sits above the group."""
    global _world
    if _world is not None:
        return _world, None
    if dist.is_available() and dist.is_initialized():  # the script formed the group itself
        _world = _adopt(backend)
        return _world, None
    if rank is None and world_size is None:  # started by srun, not by torchrun
        for name, value in from_slurm().items():
            os.environ.setdefault(name, value)
    rank = env_int("RANK", 0) if rank is None else rank
    world_size = env_int("WORLD_SIZE", 1) if world_size is None else world_size
    local_rank = env_int("LOCAL_RANK", rank)
    # Without LOCAL_RANK, ranks are numbered as if all ran on this host (local_rank = rank).
    local_world_size = env_int("LOCAL_WORLD_SIZE",
                                None if os.environ.get("LOCAL_RANK") else world_size)
    if world_size < 1:
        raise MicroDDPError(f"world size must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise MicroDDPError(f"rank {rank} is outside the world of size {world_size}")
    td = _as_timedelta(timeout)
    if world_size == 1 and store is None and init_method is None:
        chosen = None if backend is None else choose_backend(backend, local_rank)
        _world = World(0, 1, local_rank, choose_device(chosen, local_rank), None)
        return _world, None
    chosen = choose_backend(backend, local_rank, local_world_size)
    device = choose_device(chosen, local_rank)
    kwargs = store_args(init_method, store, rank, world_size, td)
    _across_hosts(master_addr(init_method, store), kwargs.get("store"), rank, world_size, td,
                  chosen)
    before_group()
    try:
        dist.init_process_group(chosen, rank=rank, world_size=world_size, timeout=td, **kwargs)
    except (RuntimeError, ValueError) as e:
        raise MicroDDPError(f"could not form the process group (rank {rank}): {e}") from None
    _world = World(rank, world_size, local_rank, device, chosen)
    if chosen == "gloo":
        # A script that never calls shutdown() would exit with gloo's threads still running,
        # which aborts the process at exit now and then (teardown.py). Leaving a gloo group
        # is local to this rank, so it is safe at exit; NCCL's may wait for the other ranks.
        atexit.register(_leave_at_exit, _world)
    return _world, td


def _across_hosts(master: str | None, store: dist.Store | None, rank: int, world_size: int,
                  td: timedelta, backend: str) -> None:
    """When the job may span hosts (MASTER_ADDR is not this host's loopback): talk on the
    interface that routes to MASTER_ADDR unless the user named one, and check through the
    store that every rank reaches every other before gloo tries (preflight.py)."""
    if master is None or store is None or is_loopback(master):
        return
    chosen = choose_interface(master)
    if backend != "gloo":  # NCCL finds its peers on its own terms (NCCL_SOCKET_IFNAME)
        if rank == 0 and chosen:
            print(f"microddp: NCCL_SOCKET_IFNAME={chosen[0]} ({chosen[1]}, the route to "
                  f"MASTER_ADDR {master})", file=sys.stderr, flush=True)
        return
    infos = preflight(store, rank, world_size, td)
    if rank == 0:
        how = (f"{chosen[0]}, the route to MASTER_ADDR {master}" if chosen else
               f"GLOO_SOCKET_IFNAME={os.environ.get('GLOO_SOCKET_IFNAME', '')!r}")
        hosts: dict[str, list[int]] = {}
        for i in infos:
            hosts.setdefault(f"{i['host']} {i['addr']}", []).append(i["rank"])
        where = ", ".join(f"{h} (ranks {','.join(map(str, r))})" for h, r in hosts.items())
        print(f"microddp: {len(hosts)} host(s) reach each other ({how}): {where}",
              file=sys.stderr, flush=True)


def get_world() -> World:
    """The World from `init`; if `init` was never called, the process group the script formed
    itself with `torch.distributed.init_process_group`, else a world of one process."""
    global _world
    if _world is not None and not _world.distributed and dist.is_available() \
            and dist.is_initialized():
        _world = None  # a world of one, assumed before the script formed its group: stale
    return _world if _world is not None else init()


def _adopt(backend: str | None) -> World:
    """The World of a default process group that something other than `init` formed (a script
    written for torch's DDP: torchrun, or mp.spawn with init_process_group)."""
    have = str(dist.get_backend())  # e.g. "gloo", "cpu:gloo,cuda:nccl", or "undefined"
    local_rank = env_int("LOCAL_RANK", None)
    if have != "nccl" and uses_nccl():
        # A group for both kinds of tensor (gloo for CPU ones): NCCL on the terms `init` picks
        # it by, a GPU for every rank of this host; a CPU job on a host with fewer GPUs than
        # ranks works in torch, so it must here too. No LOCAL_RANK: nothing says whose GPU.
        have = ("gloo" if local_rank is None else
                choose_backend(None, local_rank, env_int("LOCAL_WORLD_SIZE", None)))
    elif "gloo" in have or have == "undefined":
        have = "gloo"
    if backend is not None and backend.lower() != have:
        raise MicroDDPError(f"init(backend={backend!r}), but the process group this process "
                            f"already joined uses {have!r}; drop the argument, or form the "
                            "group with that backend")
    rank = dist.get_rank()
    if have == "nccl" and local_rank is None:
        local_rank = torch.cuda.current_device()  # the GPU the script chose with set_device
    local_rank = rank if local_rank is None else local_rank
    return World(rank, dist.get_world_size(), local_rank, choose_device(have, local_rank), have)


def is_initialized() -> bool:
    """Whether `init` was called and `shutdown` not yet."""
    return _world is not None


def _leave_at_exit(world: World) -> None:
    if _world is world:  # still in the job this init() formed: the script never left it
        shutdown()


def shutdown() -> None:
    """Leave the job: destroy the process groups (if any) so the next `init` starts afresh,
    and free them now, while Python can still run their threads' last steps (teardown.py).
    comms.shutdown (`microddp.shutdown`) stops what sits above the group first."""
    global _world
    if dist.is_available() and dist.is_initialized():
        groups = watch()
        dist.destroy_process_group()
        release(groups)
    _world = None
