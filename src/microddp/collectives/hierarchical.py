"""Hierarchical all-reduce: inside each host, then across hosts, then inside each host again.

A flat ring over several hosts sends every byte across the slow link about twice and pays its
latency at each of 2(p-1) steps. So: (1) inside each host a reduce-scatter (local rank j ends
with the host's sum of chunk j); (2) across hosts, local rank j of every host (a "rail")
all-reduces chunk j, all rails at once; (3) inside each host an all-gather. Steps 1 and 3 use
the host's shared memory where collectives/route.py allows (`intra_host_path`), else gloo's
send/recv like step 2. Hosts of unequal size cut the tensor into as many chunks as the smallest
host has ranks; a bigger host's extra ranks join steps 1 and 3 with empty chunks.

DDP starts each reduction on the hierarchy's own thread (`start`); its waits end at the world's
timeout and the hang monitor logs each one (`observe_with`), so a host lost without a word ends
the survivors with a report naming the ranks that did not answer. After one failure every later
reduction fails at once with the same error, so the rank exits promptly.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from types import FrameType

import torch
import torch.distributed as dist

from ..errors import MicroDDPError
from ..shm.group import SharedGroup
from ..transport.objects import all_gather_values
from ..transport.peers import Flat, Peers, bounds, scratch
from ..world.hosts import host_id
from ..world.world import distributed, group_timeout, uses_nccl
from .agreement.agree import agree, describe_tensor, home
from .agreement.checks import try_op, try_tensor
from .ring import all_gather_flat_, reduce_scatter_flat_
from .route import intra_host_path

OPS = ("sum", "avg", "product", "min", "max")
SETTING = "MICRODDP_HIERARCHICAL"  # "auto" (default), "1" (whenever possible), "0" (never)

# Set by the hang monitor while it runs (it sits above this layer): called on the caller's
# thread as a reduction is started, it returns what the serving thread calls when that
# reduction ends, with its error (None if it succeeded); that gives the error to raise (the
# monitor's hang report for a backend's failure).
Ended = Callable[[BaseException | None], BaseException | None]
_observer: Callable[[torch.Tensor, str, FrameType], Ended] | None = None


def observe_with(observer: Callable[[torch.Tensor, str, FrameType], Ended] | None) -> None:
    """Install the hang monitor's observer of started reductions, or None."""
    global _observer
    _observer = observer


class Hierarchy:
    """The world's ranks grouped by host (`hosts[r]` names rank r's host), and the process
    groups the three steps talk through. Forming one is collective: every rank of the world
    builds it with the same `hosts`."""

    def __init__(self, hosts: Sequence[str]) -> None:
        world = dist.get_world_size()
        if len(hosts) != world:
            raise MicroDDPError(f"Hierarchy needs one host per rank: {len(hosts)} for {world}")
        ids = list(dict.fromkeys(hosts))  # hosts in the order of their first rank
        self.members = [[r for r, h in enumerate(hosts) if h == i] for i in ids]
        self.rails = min(len(m) for m in self.members)
        self.world = world
        me = dist.get_rank()
        self.host = ids.index(hosts[me])
        self.local = self.members[self.host].index(me)
        # new_group is collective over the world: every rank forms every group, in one order,
        # each with the world's timeout (torch's default for a new group is 30 minutes).
        timeout = group_timeout()
        self.intra = self.rail = None
        for ranks in self.members:
            group = dist.new_group(ranks, timeout=timeout)
            if me in ranks:
                self.intra = group
        for j in range(self.rails):
            ranks = [m[j] for m in self.members]
            group = dist.new_group(ranks, timeout=timeout)
            if me in ranks:
                self.rail = group
        self._jobs: queue.SimpleQueue | None = None
        self.failed: BaseException | None = None  # the first reduction that failed (see start)
        # Whether this host's ranks share memory: decided now, where every rank of the host
        # is (collective over the host's group), so the first reduction finds it ready.
        intra_host_path(torch.empty(0), "sum", self.intra)

    @property
    def hosts(self) -> int:
        """How many hosts the group spans."""
        return len(self.members)

    def offsets(self, numel: int) -> list[int]:
        """Chunk boundaries for this host: one chunk per rail, then an empty one for each
        rank beyond the smallest host's count."""
        return bounds(numel, self.rails) + [numel] * (len(self.members[self.host]) - self.rails)

    def all_reduce_(self, data: torch.Tensor, name: str = "sum", shm: bool = True,
                    beside: bool = False) -> None:
        """The three steps, in place on a 1-D contiguous tensor (avg: summed, then divided).
        `shm` False keeps the steps inside a host on gloo even where shared memory could take
        them (the benchmark times both); every rank must pass the same. `beside`: this runs
        on the hierarchy's thread beside the caller's work (DDP's backward), so shared-memory
        waits give the GIL up at once instead of spinning first."""
        off = self.offsets(data.numel())
        shared = intra_host_path(data, name, self.intra) if shm else None
        intra = Peers(self.intra)
        if shared is not None:
            _shared_step(shared, data, name, off, self.local, False, beside)
        else:
            reduce_scatter_flat_(intra, data, name, off, purpose="hierarchical")
        if self.rail is not None and self.hosts > 1:
            chunk = data[off[self.local]:off[self.local + 1]]
            if chunk.numel():
                rail = Peers(self.rail)
                rail_off = reduce_scatter_flat_(rail, chunk, name, purpose="hierarchical")
                all_gather_flat_(rail, chunk, rail_off)
        if shared is not None:
            _shared_step(shared, data, name, off, self.local, True, beside)
        else:
            all_gather_flat_(intra, data, off)
        if name == "avg":
            data.div_(self.world)

    def start(self, data: torch.Tensor, name: str = "sum") -> torch.futures.Future:
        """all_reduce_ on this hierarchy's own thread; the future's value is `data`. Calls run
        one at a time in the order they were started, the same on every rank, so each group's
        messages match; the caller's thread goes on (DDP's backward keeps computing). Once one
        has failed, the later ones fail with its error, sending nothing (their peers may be
        gone, or waiting in another step)."""
        ended = _observer(data, name, sys._getframe(1)) if _observer is not None else None
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(self._jobs,), daemon=True,
                             name="microddp-hierarchical").start()
            weakref.finalize(self, self._jobs.put, None)
        fut: torch.futures.Future = torch.futures.Future()
        self._jobs.put((self, data, name, fut, ended))
        return fut


def _shared_step(shared: SharedGroup, data: torch.Tensor, name: str, off: list[int],
                 local: int, gather: bool, yielding: bool) -> None:
    """Step 1 (reduce-scatter: chunk `local` of `data` becomes the host's op over it) or step 3
    (all-gather: every chunk from its rank) through the host's shared memory. Its collectives
    take chunks of one length: equal chunks go as they are; otherwise (they differ by one
    element, or a bigger host's extra ranks have empty ones) they travel padded to the
    longest, at the price of a copy of the tensor each way."""
    n = len(off) - 1
    lengths = [off[j + 1] - off[j] for j in range(n)]
    k = max(lengths)
    if k == 0:
        return
    shared.yielding = yielding
    op = "sum" if name == "avg" else name
    if all(m == k for m in lengths):
        parts = [data[off[j]:off[j + 1]] for j in range(n)]
        if gather:
            shared.all_gather(parts, parts[local])
        else:
            mine = scratch("hierarchical-shm", k, data.dtype, data.device)
            shared.reduce_scatter(mine, parts, op)
            parts[local].copy_(mine)
        return
    padded = scratch("hierarchical-shm", (n + 1) * k, data.dtype, data.device)
    parts, mine = [padded[j * k:(j + 1) * k] for j in range(n)], padded[n * k:]
    if not gather:
        for j, part in enumerate(parts):
            part[:lengths[j]].copy_(data[off[j]:off[j + 1]])
        shared.reduce_scatter(mine, parts, op)
        data[off[local]:off[local + 1]].copy_(mine[:lengths[local]])
    else:
        mine[:lengths[local]].copy_(data[off[local]:off[local + 1]])
        shared.all_gather(parts, mine)
        for j, part in enumerate(parts):
            data[off[j]:off[j + 1]].copy_(part[:lengths[j]])


def _serve(jobs: queue.SimpleQueue) -> None:
    while (job := jobs.get()) is not None:
        hierarchy, data, name, fut, ended = job
        del job
        error = hierarchy.failed
        if error is None:
            try:
                hierarchy.all_reduce_(data, name, beside=True)
            except BaseException as e:  # noqa: BLE001 (the waiting caller raises it)
                error = e
        if ended is not None:
            error = ended(error)
        if error is None:
            fut.set_result(data)
        else:
            hierarchy.failed = hierarchy.failed or error
            fut.set_exception(error)
        del hierarchy, data, fut, ended, error


def hierarchical_all_reduce(tensor: torch.Tensor, op: str = "sum",
                            hierarchy: Hierarchy | None = None, *,
                            check: bool = True) -> torch.Tensor:
    """In place on the default group, every rank ends with op over all ranks' `tensor` (as
    ring_all_reduce), through the hosts of `hierarchy` (default: the real ones, `discover()`);
    returns `tensor`."""
    where = "hierarchical_all_reduce"
    problem = try_tensor(tensor, where)
    name = str(op)
    if problem is None:
        name, problem = try_op(op, tensor, where)
        if problem is None and name not in OPS:
            problem = MicroDDPError(f"{where}: op {name!r} is not one of {', '.join(OPS)}")
    peers = Peers()
    agree(peers, where, home(tensor, peers), problem, check, **describe_tensor(tensor), op=name)
    if peers.size <= 1:
        return tensor
    hierarchy = discover() if hierarchy is None else hierarchy
    flat = Flat(tensor)
    hierarchy.all_reduce_(flat.data, name)
    return flat.done()


_found: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # world group -> Hierarchy


def discover() -> Hierarchy:
    """The real hosts of the world's ranks (world.hosts.host_id), gathered from every rank;
    kept per process group. Collective the first time."""
    world = dist.group.WORLD
    if world not in _found:
        _found[world] = Hierarchy(all_gather_values(host_id()))
    return _found[world]


_chosen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # world group -> decision


def choose(group=None) -> Hierarchy | None:
    """Decide, once per world and on every rank alike, whether DDP over `group` all-reduces
    hierarchically: only over the whole world, when its ranks span several hosts and some share
    one (MICRODDP_HIERARCHICAL=0 never; =1 also with one rank per host). Collective the first
    time: every rank must call it, as DDP's constructor does."""
    if (group is not None and group is not dist.group.WORLD) or not distributed() or uses_nccl():
        return None  # NCCL is topology-aware already: its rings and trees go by host
    world = dist.group.WORLD
    if world in _chosen:
        return _chosen[world]
    setting = os.environ.get(SETTING, "auto")
    if setting not in ("auto", "0", "1"):
        raise MicroDDPError(f"{SETTING}={setting!r}; use 0 (flat), 1 or auto (the default)")
    seen = all_gather_values([host_id(), setting])
    if len({s for _, s in seen}) > 1:
        raise MicroDDPError(f"{SETTING} differs between ranks ({sorted({s for _, s in seen})}); "
                            "set it alike on every host, or not at all")
    hosts = [h for h, _ in seen]
    counts = [hosts.count(h) for h in dict.fromkeys(hosts)]
    worth = len(counts) > 1 and (max(counts) > 1 or setting == "1")
    if world not in _found and worth and setting != "0":
        _found[world] = Hierarchy(hosts)
    _chosen[world] = _found.get(world) if worth and setting != "0" else None
    return _chosen[world]


def chosen(group=None) -> Hierarchy | None:
    """What `choose` decided for `group`, without any communication (None if never asked)."""
    if (group is not None and group is not dist.group.WORLD) or not distributed():
        return None
    return _chosen.get(dist.group.WORLD)
