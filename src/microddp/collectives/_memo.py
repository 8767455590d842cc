"""What the ring keeps per tensor object, for as long as that tensor lives.

Two things: the views a ring all-reduce of the tensor needs (its plan, _plan.py), and, for
repeat calls with `check=False`, the whole call ready to run again (`recall`).

Why keep a whole call? Everything a rank does before its first send delays the ring, and on
this 2-core host each microsecond there cost several (a 50 us sleep there made a 64 KiB
all-reduce 1.5x as slow; our guess is that a rank which has posted its messages sleeps, and
waking it is slower than the delay). Measured interleaved on 2 ranks (`/tmp` scripts, three
runs of 300 calls), the ~10 us of checks and set-up in front of the ring's loop made a 64 KiB
all-reduce 1.19-1.53x as slow as the bare loop, and 1-4 MiB ones 0.99-1.14x (chapter 4).

A repeat call may skip them because nothing they checked can have changed: the caller
vouched for agreement across ranks (`check=False`), and what this rank's own checks looked
at (the op, the dtype, the memory layout, the group) is in the call's signature, compared
on every call.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

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

    def __len__(self) -> int:
        return len(self._entries)


_calls = PerTensor()


def _signature(tensor: torch.Tensor, op: str, group) -> tuple:
    """What a call's checks and set-up depend on, besides what check=False vouches for. The
    group is the process group object itself (None resolves to the current default group, so
    a world set up anew never meets the old one's calls)."""
    return (tensor.data_ptr(), tensor.numel(), tensor.dtype, tensor.device,
            tensor.is_contiguous(), op, group if group is not None else dist.group.WORLD)


def recall(tensor: torch.Tensor, op, group) -> Callable[[], object] | None:
    """The call `remember`ed for this tensor, op and group, if nothing it depends on changed."""
    if not isinstance(op, str) or id(tensor) not in _calls._entries:
        return None  # a ReduceOp is not remembered: comparing it with a str could raise
    return _calls.get(tensor, _signature(tensor, op, group))


def remember(tensor: torch.Tensor, op, group, run: Callable[[], object]) -> None:
    """Keep `run` (which must not hold `tensor`) to redo this call for a contiguous `tensor`."""
    if isinstance(op, str):
        _calls.put(tensor, _signature(tensor, op, group), run)


def remembered_calls() -> int:
    """How many calls are kept (for tests)."""
    return len(_calls)
