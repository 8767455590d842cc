"""The handle an asynchronous comms call returns: torch's Work, plus a finishing step.

`avg` is a sum followed by a division on this rank (portable across backends), so the handle
must not say "done" before the division has run: whichever of `wait()`, `is_completed()` or
the future's callback first sees the work complete runs it, exactly once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from ..monitor.patch import failed_wait


class Handle:
    """An async operation, like torch's Work: `wait(timeout)`, `is_completed()`, `get_future()`,
    `result()`, `exception()`, `synchronize()`.

    Each reports the operation as finished only once its finishing step (avg's division) has
    been applied, so a finished handle's tensors hold the final result.
    """

    def __init__(self, work: Any = None, finish: Callable[[], None] | None = None,
                 result: list | None = None) -> None:
        self._work, self._finish = work, finish
        self._result = result if result is not None else []  # the future's value, work-less
        self._waited = False
        # The future's callback runs on the backend's thread, wait() on the caller's.
        self._lock = threading.Lock()

    def _complete(self) -> None:
        with self._lock:
            if self._finish is not None:
                self._finish()
                self._finish = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until done, as torch's Work.wait; with `timeout`, raise if it takes longer."""
        if not self._waited:
            if self._work is not None:
                try:
                    self._work.wait() if timeout is None else self._work.wait(timeout)
                except RuntimeError as e:  # the backend gave up (a peer lost, its timeout)?
                    raised = failed_wait(e)
                    if raised is e:
                        raise
                    raise raised from None
            self._complete()
            self._waited = True
        return True

    def synchronize(self) -> None:
        """torch's Work.synchronize: the same as wait() (on NCCL, the current stream waits)."""
        self.wait()

    def result(self) -> list:
        """The output tensors, once finished (waits first, so avg's division has run)."""
        self.wait()
        return self._work.result() if self._work is not None else list(self._result)

    def exception(self):
        """The work's failure, if it failed, as torch's Work.exception gives (None if not)."""
        return self._work.exception() if self._work is not None else None

    def is_completed(self) -> bool:
        """Whether the operation has finished (then its results are in place), without waiting."""
        if self._work is not None and not self._work.is_completed():
            return False
        self._complete()
        return True

    def get_future(self) -> torch.futures.Future:
        """A Future whose value is the list of finished output tensors, as torch's Work gives
        (torch raises where the backend has no future for the op, e.g. gloo's reduce_scatter)."""
        if self._work is None:
            self._complete()
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(self._result)
            return fut
        fut = self._work.get_future()

        def finished(f: torch.futures.Future) -> Any:
            value = f.value()  # raises if the work failed: nothing to finish then
            self._complete()
            return value

        return fut.then(finished)
