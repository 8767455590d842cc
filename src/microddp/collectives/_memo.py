"""What the ring keeps per tensor object, for as long as that tensor lives.

Two things: the views a ring all-reduce of the tensor needs (its plan, _plan.py), and, for
repeat calls, the whole call ready to run again (`recall`): with `check=False` the bare loop;
with `check=True` on 2 gloo ranks the loop that carries the check beside the data
(_carried.py), its header encoded once.

Why keep a whole call? Everything a rank does before its first send delays the ring, and on
this 2-core host each microsecond there cost several (a 50 us sleep there made a 64 KiB
all-reduce 1.5x as slow; our guess is that a rank which has posted its messages sleeps, and
waking it is slower than the delay). Measured interleaved on 2 ranks (`/tmp` scripts, three
runs of 300 calls), the ~10 us of checks and set-up in front of the ring's loop made a 64 KiB
all-reduce 1.19-1.53x as slow as the bare loop, and 1-4 MiB ones 0.99-1.14x (chapter 4).

A repeat call may skip them because nothing they checked can have changed: agreement across
ranks is vouched for by the caller (`check=False`) or checked by the header each call still
sends (`check=True`), and what this rank's own checks looked
at (the op, the dtype, the memory layout, the group) is in the call's signature, compared
on every call. The memory's address is a safe test of "the same memory": the kept plan's
views keep the old storage alive, so memory swapped in later (`t.set_(...)`, `t.data =
...`) cannot sit at the same address. The group is held weakly: a kept call must not keep
a destroyed process group (and its store's port) alive.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ._duplex import duplex_enabled
from ._group import Peers

MAX_ENTRIES = 64  # per kind, oldest dropped first: a bound for code that makes endless tensors


class PerTensor:
    """A map from live tensor objects to values, each valid while its key still matches.

    Tensors are held weakly: an entry goes when its tensor is freed. Values must not hold the
    tensor either (a view holds its base): cut views from an alias over the same memory.
    """

    def __init__(self, limit: int = MAX_ENTRIES):
        self.limit = limit
        self._entries: dict[int, tuple[weakref.ref, tuple, Any]] = {}

    def get(self, tensor: torch.Tensor, key: tuple) -> Any:
        entry = self._entries.get(id(tensor))
        if entry is not None and entry[0]() is tensor and entry[1] == key:
            return entry[2]
        return None

    def put(self, tensor: torch.Tensor, key: tuple, value: Any) -> None:
        ident = id(tensor)
        if ident not in self._entries and len(self._entries) >= self.limit:
            self._entries.pop(next(iter(self._entries)))

        def forget(ref: weakref.ref, ident: int = ident) -> None:
            # Drop the entry only if it is still this tensor's: the id may be reused by then.
            if self._entries.get(ident, (None,))[0] is ref:
                del self._entries[ident]

        self._entries[ident] = (weakref.ref(tensor, forget), key, value)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether some entry was put for this tensor object (valid or not: see get)."""
        return id(tensor) in self._entries

    def __len__(self) -> int:
        return len(self._entries)


_calls = PerTensor()
_checked = PerTensor()  # calls with check=True: their loop carries the check (_carried.py)


def _signature(tensor: torch.Tensor, op, group, check: bool = False) -> tuple | None:
    """What a call's checks and set-up depend on, besides what check=False vouches for, or
    None for a call that is not kept. Only an op given as a str (the default) is kept, so
    that comparing it with whatever a caller passes next is plain string equality. The group
    is the process group object itself, held weakly (None means the current default group,
    so a world set up anew never meets the old one's calls, and a destroyed group's calls
    never match again); without one there is nothing to keep."""
    if not isinstance(op, str):
        return None
    pg = group if group is not None else dist.group.WORLD
    if not isinstance(pg, dist.ProcessGroup):
        return None  # no world, or this process is off the group (new_group gave an int)
    key = (tensor.data_ptr(), tensor.numel(), tensor.dtype, tensor.device,
           tensor.is_contiguous(), op, weakref.ref(pg))
    # A checked call's header holds the shape and the setting too: a repeat must send them
    # as they are now.
    return key + (tuple(tensor.shape), duplex_enabled()) if check else key


def recall(tensor: torch.Tensor, op, group, check: bool = False
           ) -> Callable[[Peers], object] | None:
    """The loop `remember`ed for this tensor, op, group and `check`, if nothing it depends on
    changed: call it with the group's Peers."""
    store = _checked if check else _calls
    if not store.holds(tensor):
        return None
    key = _signature(tensor, op, group, check)
    return None if key is None else store.get(tensor, key)


def remember(tensor: torch.Tensor, op, group, loop: Callable[[Peers], object],
             check: bool = False) -> None:
    """Keep `loop` to redo this call on a contiguous `tensor`. It must hold neither the
    tensor nor the group: it is given the group's Peers on every call."""
    key = _signature(tensor, op, group, check)
    if key is not None:
        (_checked if check else _calls).put(tensor, key, loop)


def remembered_calls() -> int:
    """How many calls are kept (for tests)."""
    return len(_calls)
