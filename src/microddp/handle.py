"""The handle an asynchronous comms call returns: torch's Work, plus a finishing step.

`avg` is a sum followed by a division on this rank (portable across backends), so the handle
must not say "done" before the division has run: whichever of `wait()`, `is_completed()` or
the future's callback first sees the work complete runs it, exactly once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


class Handle:
    """An async operation, like torch's Work: `wait()`, `is_completed()`, `get_future()`.

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

    def wait(self) -> bool:
        if not self._waited:
            if self._work is not None:
                self._work.wait()
            self._complete()
            self._waited = True
        return True

    def is_completed(self) -> bool:
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
