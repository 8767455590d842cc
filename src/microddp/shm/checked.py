"""Every shared-memory collective checked, in the synchronisation it makes anyway.

A group whose ranks share this host already agrees through its segment (agreement.py): each
rank writes a few numbers and posts a counter. A shared-memory collective posts a counter too,
once its input is in its slot (group.py). So a checked call posts the agreement's counter
in place of that first one: the ranks' numbers (which collective, shape, dtype, op, root, ...)
travel with no extra wait, and are compared (in C) before any rank reads another's data.
When they differ, every rank raises the agreement's error (verdict.judge: it names the rank and
what differs), and nothing has been written into any tensor.

A rank that refuses its own arguments (not a tensor, sparse, elements that share memory, a
list of the wrong length) still posts the agreement, saying so, then raises: the others,
waiting in their first synchronisation, raise too instead of waiting for it. Calls that go
through gloo on such a group (a tensor shared memory cannot carry) agree the same way first
(`agree_in_order`). Every agreement of a group runs on its lane (lane.py), after the
calls queued there, so that each rank's agreements are in the order of its calls.
"""

from __future__ import annotations

import array
import weakref
from functools import partial
from types import SimpleNamespace

import torch

from ..errors import MicroDDPError
from ..transport.peers import Peers
from ..transport.sized_tags import settle
from .agreement import Check, SharedAgreement
from .verdict import described, encode, judge

# (where, fields) -> this rank's numbers: encoding costs a few microseconds (a crc32 per
# field), and training loops repeat the same few calls.
_memo: dict[tuple, tuple[array.array, dict]] = {}
_MEMO_KEPT = 256


def numbers(where: str, fields: dict, problem: Exception | None = None
            ) -> tuple[array.array, dict]:
    """The agreement's numbers for a call of `where` with `fields` (and the fields as
    verdict.described lists them, for its error)."""
    key = (where, problem is not None, *fields.items())
    got = _memo.get(key)
    if got is None:
        if len(_memo) >= _MEMO_KEPT:
            _memo.clear()
        full = described(where, problem, fields, {})
        got = _memo[key] = (array.array("q", encode(full)), full)
    return got


def read_in_memory(peers: Peers, box: SharedAgreement, seq: int, mine: array.array, where: str,
                   fields: dict, settings: dict, problem: Exception | None,
                   early: tuple[int, int] | None = None, works: tuple = ()) -> None:
    """Read agreement `seq` (this rank posted `mine`, encode(fields)); on a mismatch, or this
    rank's own `problem`, settle what either of 2 ranks sent or posted early on sized tags
    (transport/sized_tags.py; `early`: this rank's own (send, receive) tags, `works` its own early
    messages not yet waited for) and raise, on every rank, what the agreement found."""
    combined = box.result(seq, mine, where)  # None: every rank posted these very numbers
    if problem is None and combined is None:
        return
    theirs = box.extra(seq, 1 - peers.me) if peers.size == 2 else (0, 0)
    if theirs[0] or early is not None:  # an early ring on either side: take and fill
        settle(peers, 1 - peers.me, theirs if theirs[0] else None, early, list(works))
    judge(where, peers.me, fields, settings, combined or mine.tolist(), problem)
    raise MicroDDPError(f"{where}: the ranks' checks differ in a number no field holds; every "
                        "rank of the group must call the same collectives, in the same "
                        "order")  # judge raises first: a defence, never seen


def tensor_fields(tensor, **more) -> dict:
    """What the ranks of a call must pass alike about `tensor` (placeholders for a
    non-tensor, whose rank refuses it), then `more`."""
    if not isinstance(tensor, torch.Tensor):
        return {"shape": None, "dtype": None, "device": None, **more}
    return {"shape": tuple(tensor.shape), "dtype": tensor.dtype, "device": tensor.device.type,
            **more}


def _peers(group, box: SharedAgreement):
    """Who raises: the group's Peers (a rank may have sent a ring's first step early, which
    read_in_memory settles), or, for the torch backend's own group (group False here), its rank
    and size alone (nothing but its own collectives meets in its segment)."""
    if group is False:
        return SimpleNamespace(me=box.rank, size=box.size)
    return Peers(group)


def check(box: SharedAgreement, group, where: str, fields: dict) -> Check:
    """The Check a shared-memory call of `where` makes in its first synchronisation
    (group.py). `group`: the microddp group, or False for the torch backend's."""
    mine, full = numbers(where, fields)

    def refuse(seq: int) -> None:
        read_in_memory(_peers(group, box), box, seq, mine, where, full, {}, None)

    return Check(mine, refuse)


def agree_now(box: SharedAgreement, group, where: str, fields: dict,
              problem: Exception | None, yielding: bool = False) -> None:
    """An agreement on its own (a call that goes through gloo, or refuses its arguments):
    raise, on every rank, if the ranks' numbers differ, and this rank's `problem` if any.
    On the lane's thread or with the lane idle (agree_in_order)."""
    mine, full = numbers(where, fields, problem)
    seq = box.post(mine)
    if problem is None and box.result(seq, mine, where, yielding) is None:
        return
    read_in_memory(_peers(group, box), box, seq, mine, where, full, {}, problem)


def agree_in_order(lane, box: SharedAgreement, group, where: str, fields: dict,
                   problem: Exception | None) -> None:
    """agree_now, behind the calls queued on the group's lane (here, on this thread, when
    none is): a rank's agreements then follow the order of its calls."""
    lane.submit(lambda yielding: agree_now(box, group, where, fields, problem, yielding), [],
                async_op=False)


# bench allreduce's switch, and only its: the default call timed without its check beside the
# default call (the row "shm check"). Read once per comms.all_reduce through shared memory.
CHECKING = True


# comms.all_reduce's shared-memory path, the hot one (every DDP bucket): a group's Checks kept
# on its agreement, keyed on the tensor's own shape, dtype and op (no fields built, no closure
# made per call), holding the group weakly (the group's shared memory lives as long as it).
_KEPT = "_checks"


def all_reduce_fields(tensor, op: str) -> dict:
    """What comms.all_reduce's ranks must pass alike, whichever way the call goes: with
    `contiguous`, since shared memory carries only a contiguous tensor and the ranks must
    take the same way."""
    contiguous = isinstance(tensor, torch.Tensor) and tensor.is_contiguous()
    return tensor_fields(tensor, op=op, contiguous=contiguous)


def all_reduce_check(box: SharedAgreement, group, tensor: torch.Tensor, op: str) -> Check:
    """check() for comms.all_reduce's shared-memory path (a contiguous CPU tensor)."""
    kept = box.__dict__.setdefault(_KEPT, {})
    key = (tensor.shape, tensor.dtype, op)
    got = kept.get(key)
    if got is None:
        if len(kept) >= _MEMO_KEPT:
            kept.clear()
        mine, full = numbers("all_reduce", all_reduce_fields(tensor, op))
        got = kept[key] = Check(mine, partial(_refuse, weakref.ref(box), _weakly(group), mine,
                                              full))
    return got


def _weakly(group):
    """A way back to `group` that does not keep it alive (None: the default group)."""
    return (lambda: None) if group is None else weakref.ref(group)


def _refuse(box_ref, group_ref, mine: array.array, full: dict, seq: int) -> None:
    box = box_ref()
    read_in_memory(_peers(group_ref(), box), box, seq, mine, "all_reduce", full, {},
                         None)
