"""Every rank of a pipeline agrees on a step before any activation moves.

A pipeline's ranks see different parts of a step: the first stage's rank the batch, the last
stage's the target, the ones between nothing. A mistake seen on one rank only (a batch of
another size, a width or dtype one rank built differently, a missing target) used to stop that
rank alone, while the others waited to the timeout for messages that never came, or sent
messages of a size the receiver did not expect (gloo aborts). Here each rank puts what it
knows into one small vector and the group takes its maximum in one all-reduce: every rank
then holds the same numbers and makes the same decision, so a refusal is the same
MicroDDPError on every rank at once, and a batch size only the first stage's rank knows
reaches all (the torch-shaped schedules re-infer their shapes when it changes). Fields
every rank must pass alike go as (v, -v), so the maximum gives both their max and min;
fields some ranks know go the same way with a placeholder elsewhere; `slots` are numbers one
rank each fills in (a stage's widths), zero elsewhere.
"""

from __future__ import annotations

import zlib

import torch

from .. import comms
from ..comms import distributed
from ..errors import MicroDDPError
from ..world.world import uses_nccl

UNKNOWN = -(2**62)  # a known field's min-half placeholder on a rank that does not know it


def code(value) -> int:
    """A stable integer for a name (Python's hash() differs per process)."""
    return value if isinstance(value, int) else zlib.crc32(repr(value).encode())


def agree_step(group, where: str, problem: Exception | None, *, equal: dict,
               known: dict | None = None, slots: list[int] | None = None,
               device: torch.device | None = None) -> tuple[dict, list[int]]:
    """Share this rank's `problem` and its fields with every rank of `group`; raise the same
    MicroDDPError on every rank if any rank had a problem or the `equal` fields differ or
    two ranks know a `known` field differently. Returns ({known field: its value, or None
    if no rank knows it}, the slots' maximum over ranks). Collective over `group`."""
    return start_agreement(group, where, problem, equal=equal, known=known, slots=slots,
                           device=device).result()


class Agreement:
    """An agreement under way (its all-reduce posted): `result()` waits for it and returns
    what agree_step does, raising what it raises. Started early, its round trip overlaps the
    first stage's first forward, which needs no message: a step pays little for it."""

    def __init__(self, where: str, problem: Exception | None, equal: dict, known: dict,
                 slots: list[int], me: int, buf: torch.Tensor | None, handle) -> None:
        self.where, self.problem, self.equal, self.known = where, problem, equal, known
        self.slots, self.me, self.buf, self.handle = slots, me, buf, handle

    def result(self) -> tuple[dict, list[int]]:
        """Wait for the agreement; raise every rank's error, else (the agreed fields, widths)."""
        if self.buf is None:  # a world of one: nothing was sent
            if self.problem is not None:
                raise self.problem
            return dict(self.known), list(self.slots)
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
        got = self.buf.tolist()
        where, equal, me = self.where, self.equal, self.me
        if got[0]:
            if self.problem is not None:
                raise self.problem
            raise MicroDDPError(f"{where}: group rank {got[0] - 1} of the pipeline refused "
                                "this step (its error says why); every rank stops here")
        at = 1
        differ = []
        for name in equal:
            if got[at] != -got[at + 1]:
                differ.append(name)
            at += 2
        if differ:
            mine = ", ".join(f"{n}={equal[n]}" for n in differ)
            raise MicroDDPError(f"{where}: the pipeline's ranks disagree on "
                                f"{' and '.join(differ)} (this rank, group rank {me}: {mine}); "
                                "every rank must call it alike")
        values = {}
        for name in self.known:
            high, low = got[at], -got[at + 1]
            if high >= 0 and low != -UNKNOWN and high != low:
                raise MicroDDPError(f"{where}: the ranks that know {name} disagree on it "
                                    f"({low} and {high}); pass the same on every rank that "
                                    "passes it")
            values[name] = high if high >= 0 else None
            at += 2
        return values, got[at:]


def start_agreement(group, where: str, problem: Exception | None, *, equal: dict,
                    known: dict | None = None, slots: list[int] | None = None,
                    device: torch.device | None = None) -> Agreement:
    """agree_step's all-reduce, posted and not waited for (waited for at once when this rank
    has a problem: nothing else may start)."""
    known, slots = known or {}, slots or []
    if not distributed(group) or comms.group_size(group) == 1:
        return Agreement(where, problem, equal, known, slots, 0, None, None)
    me = comms.group_rank(group)
    words = [me + 1 if problem is not None else 0]
    for value in equal.values():
        words += [code(value), -code(value)]
    for value in known.values():
        words += [-1, UNKNOWN] if value is None else [value, -value]
    words += slots
    place = device if device is not None else torch.device("cpu")
    if uses_nccl(group) and place.type != "cuda":
        place = torch.device("cuda", torch.cuda.current_device())
    buf = torch.tensor(words, dtype=torch.int64, device=place)
    handle = comms.all_reduce(buf, op="max", group=group, async_op=problem is None)
    return Agreement(where, problem, equal, known, slots, me, buf, handle)
