"""Running a group's shared-memory collectives in the order they were issued, some of them
asynchronously, and the handle (`ShmWork`) an asynchronous one returns.

A group has one lane: a thread that runs the calls made with async_op=True one after another,
so DDP's bucket all-reduces overlap with backward as gloo's do. A blocking call runs on the
caller's thread when nothing is queued (the fast case: no hand-over between threads), else it
queues behind the others and waits, so calls always run in the order they were made. The
tensor work releases the GIL, and so does the lane's waiting for its peers (shm/segment.py).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from ..errors import MicroDDPError


class ShmWork:
    """Like torch's Work: wait(timeout), is_completed(), get_future(), result(), exception()."""

    def __init__(self, result: list) -> None:
        self._result = result
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._future: torch.futures.Future | None = None
        self._finished = False
        self._lock = threading.Lock()

    def finish(self, error: BaseException | None = None,
               hand_off: Callable[[Callable[[], None]], None] | None = None) -> None:
        """Mark the call finished (with `error`, if it failed): complete its future, wake waiters.
        With `hand_off` (the lane's), a future is completed on a thread it gives, not this one:
        see Deliveries."""
        self._error = error
        with self._lock:  # a future made from here on is completed by get_future itself
            self._finished, fut = True, self._future
        if fut is None:
            self._done.set()
        elif hand_off is None:
            self._complete(fut)
        else:
            hand_off(lambda: self._complete(fut))

    def _complete(self, fut: torch.futures.Future) -> None:
        self._deliver(fut)  # its callbacks run before wait() returns, as with torch's Work
        self._done.set()

    def _deliver(self, fut: torch.futures.Future) -> None:
        if self._error is None:
            fut.set_result(self._result)
        else:
            fut.set_exception(self._error)

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the call finishes (or `timeout` passes); raise its error, if any."""
        seconds = None if timeout is None else timeout.total_seconds()
        if not self._done.wait(seconds):
            late = MicroDDPError(f"a shared-memory collective did not complete within "
                                 f"{seconds:g} s (Work.wait's timeout)")
            late.timed_out = True  # the hang monitor answers it with its report (patch.py)
            raise late
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        """Whether the call has finished (with or without an error)."""
        return self._done.is_set()

    def is_success(self) -> bool:
        """Whether the call finished without an error."""
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        """The error the call ended with, or None."""
        return self._error

    def result(self) -> list:
        """The call's output tensors, after waiting for it."""
        self.wait()
        return self._result

    def synchronize(self) -> None:
        """Wait for the call (torch's Work API: CPU work has nothing else to synchronise)."""
        self.wait()

    def get_future(self) -> torch.futures.Future:
        """A Future completed when the call is (torch's Work.get_future), for DDP's callbacks."""
        with self._lock:
            if self._future is None:
                self._future = torch.futures.Future()
                if self._finished:
                    self._deliver(self._future)
            return self._future


Task = Callable[[bool], None]  # task(yielding): run the collective


class Deliveries:
    """Threads that complete asynchronous calls' futures, so that the lane never runs a
    future's callbacks itself.

    torch runs a future's callbacks (`.then`) on the thread that completes it, and a callback
    may issue a collective on the same group and wait for it (torch's PowerSGD and
    quantization hooks do). Run on the lane's thread, that wait would be for work only the
    lane can run: a hang, for good (`Future.wait` has no timeout). So the lane hands each
    completion here and goes on. One thread does them in order while it keeps up; when every
    thread here is inside a callback (one that waits, as above), the next completion gets a
    thread of its own, as gloo's completions run on a pool of worker threads."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._threads: list[threading.Thread] = []

    def post(self, complete: Callable[[], None]) -> None:
        """Run `complete()` on a delivery thread: an idle one, or a new one if none is."""
        with self._lock:
            if self._idle:
                self._idle -= 1  # taken: a second post before it wakes must not count it
            else:
                thread = threading.Thread(target=self._serve, daemon=True,
                                          name=f"microddp-shm-{self.name}-done")
                self._threads.append(thread)
                thread.start()
        self._queue.put(complete)

    def _serve(self) -> None:
        while True:
            complete = self._queue.get()
            if complete is None:
                return
            complete()
            del complete
            with self._lock:
                self._idle += 1

    def close(self, timeout_s: float) -> None:
        """Stop the threads once the completions posted before this have run."""
        with self._lock:
            threads, self._threads = self._threads, []
        for _ in threads:
            self._queue.put(None)
        for thread in threads:
            if thread is not threading.current_thread():  # a callback may end the group
                thread.join(timeout_s)


class Lane:
    """One group's queue of collectives and the thread that runs the asynchronous ones."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _pending and _thread
        self._running = threading.Lock()  # one collective of the group at a time
        self._pending = 0  # queued or running
        self._thread: threading.Thread | None = None
        self._deliveries = Deliveries(name)

    def run_now(self, fn: Callable[..., None], *args: Any) -> bool:
        """`fn(*args)` on this thread if nothing is queued or running, and True once it is
        done; False, having run nothing, when the call must queue behind others (`submit`).
        How every blocking call runs when it can (`submit` too): no counter under a lock, one
        non-blocking acquire (a small all-reduce is a few tens of microseconds, so each one
        counts); comms' all-reduce calls it directly, without even a task's closure."""
        if self._pending or not self._running.acquire(blocking=False):
            return False
        try:
            if self._pending:  # another thread queued a call in between: it goes first
                return False
            fn(*args)
            return True
        finally:
            self._running.release()

    def drain(self) -> None:
        """Return once the calls queued before this one have run: a caller about to agree
        through the group's segment on its own thread (a ring, a tree) must not overtake a
        queued call, which agrees there too (checked.py)."""
        if self._pending:
            self.submit(lambda yielding: None, [], async_op=False)

    def submit(self, task: Task, result: list, async_op: bool) -> ShmWork | None:
        """Run `task`: now, on this thread, if it blocks and nothing is queued (None once it
        is done); else behind the queued ones (a ShmWork if `async_op`, else None once done)."""
        if not async_op and self.run_now(task, False):
            return None
        if torch.is_inference_mode_enabled():
            task = _in_inference_mode(task)
        work = ShmWork(result)
        with self._lock:
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=f"microddp-shm-{self.name}",
                                                daemon=True)
                self._thread.start()
        self._queue.put((task, work))
        if async_op:
            return work
        work.wait()
        return None

    def _serve(self) -> None:
        while True:
            item: Any = self._queue.get()
            if item is None:
                return
            task, work = item
            del item
            error = None
            with self._running:
                try:
                    task(True)
                except BaseException as e:  # noqa: BLE001 (handed to whoever waits on the work)
                    error = e
            # Let go of the task (and the views of its tensors) BEFORE the call is reported
            # done: DDP lends a bucket's memory to .grad only while nothing else holds it, and
            # the waiting thread may look as soon as finish() wakes it (a reference kept until
            # this loop came round again made the bucket move to fresh memory, under load).
            del task
            with self._lock:
                self._pending -= 1
            work.finish(error, self._deliveries.post)
            del work

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the thread once the calls queued before this have run."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout_s)
        self._deliveries.close(timeout_s)


def _in_inference_mode(task: Task) -> Task:
    """`task` run under inference mode, as its caller was: the mode is per thread, and the
    lane's thread writing into a tensor made under it (an output the caller allocated there)
    would be refused ("Inplace update to inference tensor outside InferenceMode"), where gloo,
    writing from C++, is not."""

    def run(yielding: bool) -> None:
        with torch.inference_mode():
            task(yielding)

    return run
