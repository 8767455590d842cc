"""What an agreement compares and how it judges: the numbers every rank sends, and the one
error all of them raise when the numbers differ.

Each rank encodes its call (which collective, its shape, dtype, op, root, and the settings the
algorithm needs alike) as SLOTS integer codes followed by the same codes negated: the maximum
over ranks of that message then holds both the maximum and the minimum of every field, so one
max-reduction (agree.py's butterfly through the backend, or shm/agreement.py's read of every
rank's line in shared memory) tells each rank which fields differ. `judge` turns that into the
same MicroDDPError on every rank, naming the field and this rank's value. It sits with shared
memory (the lowest layer that agrees) so that shm/ and collectives/ both read it from below.
"""

from __future__ import annotations

import operator
import zlib

from ..errors import MicroDDPError

# Every agreement exchanges this many numbers, whatever the collective: ranks that called
# different ones (a ring here, a tree there) then still exchange equal messages, and learn
# that they disagree, instead of gloo aborting the process on mismatched sizes.
SLOTS = 10


def code(value) -> int:
    """A stable integer for a shape, a dtype or a name (Python's hash() differs per process)."""
    try:
        return operator.index(value)  # an int, or a numpy integer: the same number
    except TypeError:
        return zlib.crc32(repr(value).encode())


def described(where: str, problem: Exception | None, fields: dict, settings: dict) -> dict:
    """Every field an agreement compares, in the order it sends them: whether this rank
    rejected its arguments, which collective it called, its arguments, then `settings`."""
    return {"arguments": int(problem is not None), "call": where, **fields, **settings}


def encode(fields: dict) -> list[int]:
    """The numbers an agreement sends for `fields` (from `described`): each field's code, then
    each code negated, SLOTS of each, so that max over ranks gives both max and min."""
    codes = [code(v) for v in fields.values()]
    codes += [0] * (SLOTS - len(codes))  # fixed length: see SLOTS
    return codes + [-c for c in codes]


def judge(where: str, me: int, fields: dict, settings: dict, combined: list[int],
          problem: Exception | None) -> None:
    """Raise what an agreement found, given `combined`: the max over every rank's `encode`d
    fields (so the max of each field, then minus its min). `me`: this rank's group rank."""
    k = len(fields)
    highs, lows = combined[:k], [-v for v in combined[SLOTS:SLOTS + k]]
    if problem is not None:
        raise problem
    if highs[0]:
        raise MicroDDPError(f"{where}: another rank of the group rejected its arguments (its "
                            "error says why); fix them there")
    differ = [name for name, hi, lo in zip(fields, highs, lows, strict=True) if hi != lo]
    if "call" in differ:
        raise MicroDDPError(
            f"{where}: the ranks of the group called different collectives at this point (this "
            f"rank, group rank {me}, called {where}); every rank of the group must call "
            "the same collectives, in the same order")
    if differ:
        # Every argument, but a setting only when it is what differs: otherwise it is noise.
        shown = [n for n in list(fields)[2:] if n not in settings or n in differ]
        mine = ", ".join(f"{name}={fields[name]}" for name in shown)
        raise MicroDDPError(
            f"{where}: ranks disagree on {' and '.join(differ)} (this rank, group rank "
            f"{me}: {mine}); every rank of the group must call it with the same "
            f"{', '.join(differ)}")
