"""torch's Work for a call that runs on a group's shared-memory lane.

torch.distributed hands every collective's result back as a `torch.distributed.Work`:
`dist.all_reduce` calls `wait()` on it, and DDP's reducer (C++) chains its bucket's next step
on `get_future()`. A Python subclass of torch's Work is how a Python process group returns
one (torch's test of Python process groups, test_c10d_pypg.py, does the same); this one
forwards both to the lane's `ShmWork`, which completes its future from the lane's thread.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from ..shm.lane import ShmWork


class LaneWork(dist.Work):
    """A shared-memory call, as torch's Work: wait(), get_future(), is_completed()."""

    def __init__(self, work: ShmWork) -> None:
        super().__init__()
        self._work = work

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Block until the call is done; raise its error (a dead peer, the group's timeout).
        torch's "no timeout" is a zero timedelta."""
        self._work.wait(timeout if timeout and timeout.total_seconds() > 0 else None)
        return True

    def get_future(self) -> torch.futures.Future:
        """Completed with the call's output tensors when it is done (DDP's reducer waits on it)."""
        return self._work.get_future()

    def is_completed(self) -> bool:
        """Whether the call has finished, with or without an error."""
        return self._work.is_completed()

    def is_success(self) -> bool:
        """Whether the call has finished without an error."""
        return self._work.is_success()

    def exception(self) -> BaseException | None:
        """The call's error, or None."""
        return self._work.exception()

    def result(self) -> list:
        """The call's output tensors, once it is done."""
        return self._work.result()
