"""Every rank arrives at a call that all must make, or a clear error within the timeout.

torch's `new_group` must be called by every rank, members or not; a rank that never calls it
leaves the others inside gloo's connection set-up, waiting on the store with the store's own
timeout (minutes) and then failing with words about keys. So before it, each rank notes its
arrival in the job's store and waits, with the group's timeout, for every other rank's: a rank
that does not come is named, in one line, on every rank that did.
"""

from __future__ import annotations

import itertools
from datetime import timedelta

import torch.distributed as dist

from ..errors import MicroDDPError

_calls: dict[str, itertools.count] = {}


def all_arrive(what: str, ranks: list[int], me: int, timeout_s: float) -> None:
    """Wait until every rank of `ranks` has called `what` as often as this one (its n-th call
    meets theirs); MicroDDPError naming the ranks that did not, after `timeout_s`."""
    n = next(_calls.setdefault(what, itertools.count(1)))
    store = dist.distributed_c10d._get_default_store()
    key = f"microddp/arrived/{what}/{n}/"
    store.set(key + str(me), b"1")
    keys = [key + str(r) for r in ranks]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except RuntimeError:  # the store's timeout (DistStoreError): who is missing?
        missing = [r for r, k in zip(ranks, keys, strict=True) if not store.check([k])]
        if not missing:
            return
        raise MicroDDPError(
            f"{what} #{n}: rank{'s' if len(missing) > 1 else ''} "
            f"{','.join(map(str, missing))} did not call {what} within {timeout_s:g} s; every "
            f"rank must call {what} (members of the new group or not), in the same order"
        ) from None
