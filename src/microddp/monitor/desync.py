"""Debug mode: before each collective, ranks compare what they are about to call.

Each rank writes its entry's fingerprint (op, shape, dtype, reduce op, root) under the
collective's number in the store and reads everyone else's. A difference is reported before the
collective runs, naming each rank's call and line; a rank that never arrives is a hang and gets
the hang report. It costs a few store round trips per collective: for finding bugs, not speed.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..errors import MicroDDPError, PeerError
from .hang import Monitor
from .log import Entry


def _members(group: Any, world_size: int) -> list[int]:
    if group is None or group is dist.GroupMember.WORLD:
        return list(range(world_size))
    return list(dist.get_process_group_ranks(group))


def check(mon: Monitor, entry: Entry, group: Any) -> None:
    """Raise MicroDDPError if the ranks of `group` disagree on collective #entry.seq."""
    ranks = _members(group, mon.world_size)
    mine = dict(entry.fingerprint(), caller=entry.caller)
    mon.store.set(mon.key("fp", entry.group, entry.seq, mon.rank), json.dumps(mine))
    keys = {r: mon.key("fp", entry.group, entry.seq, r) for r in ranks}
    try:
        mon.store.wait(list(keys.values()), timedelta(seconds=mon.timeout_s))
    except Exception:  # noqa: BLE001 (a store timeout: some rank never got here)
        text = mon.collect(entry, why="debug mode: not every rank reached it")
        mon.log.end(entry)
        raise PeerError(text) from None
    theirs = {r: json.loads(mon.store.get(k)) for r, k in keys.items()}
    if entry.seq > 1:  # everyone has read the previous round, since they all reached this one
        mon.store.delete_key(mon.key("fp", entry.group, entry.seq - 1, mon.rank))
    plain = {r: {k: v for k, v in fp.items() if k != "caller"} for r, fp in theirs.items()}
    if all(fp == plain[ranks[0]] for fp in plain.values()):
        return
    mon.log.end(entry)
    lines = [f"microddp desync: collective #{entry.seq} differs across ranks"]
    for r, fp in theirs.items():
        what = " ".join(x for x in (fp["shape"], fp["detail"]) if x)
        lines.append(f"  rank {r}: {fp['op']} ({what}) called from {fp['caller']}")
    lines.append("fix: every rank must pass tensors of the same shape and dtype, the same op "
                 "and the same root to each collective")
    raise MicroDDPError("\n".join(lines))
