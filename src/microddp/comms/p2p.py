"""Point-to-point with the sizes checked: a send and its receive agree before data moves.

gloo matches a send with a receive on (peer, tag) alone: a message larger than the receive
aborts the receiving process (SIGABRT), a smaller one leaves the rest of the buffer as it was,
and another dtype of the same size is read as the wrong numbers. So each message here goes
with two small fixed-size ones on tags of their own: the sender's header (its
numel, dtype and rank) to the receiver, and the receiver's expectation back. All are posted
when the call is made (isend, irecv), with the receive of the data; the data itself leaves
once the sender has read the expectation. Every message that can meet another is then of one
size, so gloo never aborts, and both ranks compare the same two headers: a mismatch is the
same MicroDDPError on both, after the sender has filled the receive with zeros so that it
is not left posted for a later message to fall into.

Nothing waits for the other rank's wait(): isend then irecv then wait on either, in any order,
completes on a ring as it does with torch's calls. A receive from any rank (src=None) learns
its sender from the header, so its expectation leaves only in its wait(). The cost is the
expectation's trip before the data. Sends to one peer on one tag leave in the order they were
made, whatever order their handles are waited in.
"""

from __future__ import annotations

import threading
import zlib
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import MicroDDPError

# A user's tag t: its data travels on 3t, a send's header on 3t+1, a receive's expectation on
# 3t+2 (apart: a rank may send to a peer and receive from it on one tag at once, as a
# parameter server does). gloo takes tags below 2**31.
MAX_TAG = ((1 << 31) - 1) // 3 - 1
_WORDS = 4  # numel, dtype, global rank, nbytes


def data_tag(tag: int) -> int:
    """The tag the data itself travels on (the user's tag t, as 3t)."""
    return 3 * _checked_tag(tag)


def header_tag(tag: int) -> int:
    """The tag of a send's header (sender to receiver)."""
    return 3 * _checked_tag(tag) + 1


def expectation_tag(tag: int) -> int:
    """The tag of a receive's expectation (receiver to sender)."""
    return 3 * _checked_tag(tag) + 2


def _checked_tag(tag: int) -> int:
    if not isinstance(tag, int) or not 0 <= tag <= MAX_TAG:
        raise MicroDDPError(f"a send/recv tag must be an int from 0 to {MAX_TAG}, not {tag!r}")
    return tag


def _header(tensor: torch.Tensor) -> torch.Tensor:
    code = zlib.crc32(str(tensor.dtype).encode())
    return torch.tensor([tensor.numel(), code, dist.get_rank(), _nbytes(tensor)],
                        dtype=torch.int64)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


_NAMES = {zlib.crc32(str(d).encode()): str(d).removeprefix("torch.") for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128)}


def _says(h: torch.Tensor) -> str:
    numel, code = int(h[0]), int(h[1])
    return f"{numel} element{'s' if numel != 1 else ''} of {_NAMES.get(code, 'another dtype')}"


def _mismatch(sent: torch.Tensor, expected: torch.Tensor, tag: int) -> MicroDDPError | None:
    """The error both ranks raise when a send and its receive differ (the same words on both)."""
    if int(sent[0]) == int(expected[0]) and int(sent[1]) == int(expected[1]):
        return None
    s, r = int(sent[2]), int(expected[2])
    return MicroDDPError(
        f"send/recv mismatch (tag {tag}): rank {s} sends {_says(sent)}, rank {r} receives "
        f"{_says(expected)}; a send and its receive must have the same number of elements "
        "and dtype (the receiving tensor is left zeroed)")


def _wait(work, timeout: timedelta | None) -> None:
    work.wait() if timeout is None else work.wait(timeout)


class _Send:
    """One send: its header out, the receiver's expectation in, then the data (or zeros)."""

    def __init__(self, tensor: torch.Tensor, dst: int, group, tag: int) -> None:
        self.tensor, self.dst, self.group, self.tag = tensor, dst, group, tag
        self.head = _header(tensor)
        self.expected = torch.zeros(_WORDS, dtype=torch.int64)
        self.works = [dist.isend(self.head, dst, group, header_tag(tag))]
        self.expectation = dist.irecv(self.expected, dst, group, expectation_tag(tag))
        self.data = None  # the data's (or the zeros') send, once the expectation is read
        self.error: MicroDDPError | None = None  # the receive differs
        self.failed: MicroDDPError | None = None  # no receive came

    def go(self, timeout: timedelta | None) -> None:
        """Read the expectation, then send the data, or zeros of the receive's size."""
        _wait(self.expectation, timeout)
        self.error = _mismatch(self.head, self.expected, self.tag)
        out = self.tensor if self.error is None else torch.zeros(
            int(self.expected[3]), dtype=torch.uint8)
        self.data = (dist.isend(out, self.dst, self.group, data_tag(self.tag))
                     if out.numel() else None)


# (group, dst, tag) -> sends not yet gone, oldest first, and the thread that sends them in
# that order, each as soon as its expectation is in: as torch's isend, the data leaves without
# a wait(), so a rank that goes on to compute, or to a collective, does not hold a peer's
# receive. (A gloo receive says it is complete only once waited for: no polling, a thread.)
_queues: dict[tuple, deque] = {}
_lock = threading.Lock()


def _go(send: _Send) -> None:
    try:
        send.go(None)
    except RuntimeError as e:  # the group's timeout, a lost peer: wait() raises it
        send.failed = MicroDDPError(
            f"send to rank {send.dst} (tag {send.tag}): Timed out, or the peer is gone: no "
            f"receive of rank {send.dst} met it within the group's timeout "
            f"({str(e).splitlines()[0]}); is rank {send.dst} sending too (a deadlock)?")
    send.gone.set()


def _sender(key: tuple) -> None:
    while True:
        with _lock:
            queue = _queues.get(key)
            if not queue:
                _queues.pop(key, None)
                return
            head = queue[0]
        _go(head)
        with _lock:
            queue.popleft()


class SendWork:
    """A send's Work: the data leaves once the receiver's expectation is in, after every
    older send to the same peer on the same tag (the thread above); wait() waits for it."""

    def __init__(self, tensor: torch.Tensor, dst: int, group, tag: int,
                 blocking: bool = False) -> None:
        self._send = _Send(tensor, dst, group, tag)
        self._send.gone = threading.Event()
        key = (id(group) if group is not None else None, dst, tag)
        self._done = False
        with _lock:
            if blocking and key not in _queues:  # nothing older to go first: go from here
                blocking = None
        if blocking is None:
            _go(self._send)
            return
        with _lock:
            queue = _queues.get(key)
            if queue is None:
                queue = _queues[key] = deque()
                threading.Thread(target=_sender, args=(key,), name="microddp-send",
                                 daemon=True).start()
            queue.append(self._send)

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the data has left (after the receiver's expectation was read)."""
        if not self._done:
            s = self._send
            if not s.gone.wait(None if timeout is None else timeout.total_seconds()):
                raise MicroDDPError(f"send to rank {s.dst} (tag {s.tag}): no receive posted "
                                    f"within {timeout.total_seconds():g} s")
            if s.failed is not None:
                self._done = True
                raise s.failed
            for work in [*s.works, *([s.data] if s.data is not None else [])]:
                _wait(work, timeout)
            self._done = True
            if s.error is not None:
                raise s.error
        return True

    def is_completed(self) -> bool:
        """As gloo's send: done once waited for (chapter 2), not when the bytes left."""
        return self._done

    def exception(self):
        """The error this Work ended with, or None (as torch's Work)."""
        return self._send.failed or self._send.error

    def result(self) -> list:
        """The tensors of the call, as torch's Work.result()."""
        self.wait()
        return [self._send.tensor]


class RecvWork:
    """A receive's Work: the header in and the expectation out are posted at once; wait()
    compares them and returns the data, or raises the mismatch once the zeros are in."""

    def __init__(self, tensor: torch.Tensor, src: int | None, group, tag: int) -> None:
        self.tensor, self.src, self.group, self.tag = tensor, src, group, tag
        self.sent = torch.zeros(_WORDS, dtype=torch.int64)
        self.mine = _header(tensor)
        self.header = dist.irecv(self.sent, src, group, header_tag(tag))
        self.works: list = []
        self.data = None
        if src is not None:
            self._post(src)
        self._done, self.error = False, None
        self.sender = src

    def _post(self, src: int) -> None:
        self.works.append(dist.isend(self.mine, src, self.group, expectation_tag(self.tag)))
        if self.tensor.numel():
            self.data = dist.irecv(self.tensor, src, self.group, data_tag(self.tag))

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the data left (a send) or arrived and was checked (a receive);
        raise the mismatch, on both ranks, if the two ends differ."""
        if self._done:
            if self.error is not None:
                raise self.error
            return True
        _wait(self.header, timeout)
        if self.src is None:  # from any rank: now we know which
            self.sender = int(self.sent[2])
            self._post(self.sender)
        self.error = _mismatch(self.sent, self.mine, self.tag)
        for work in [*self.works, *([self.data] if self.data is not None else [])]:
            _wait(work, timeout)
        self._done = True
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        """Whether wait() would return at once, without blocking."""
        if self._done:
            return True
        if self.src is None or not all(
                w.is_completed() for w in [self.header, *self.works,
                                           *([self.data] if self.data else [])]):
            return False
        try:
            self.wait()
        except MicroDDPError:  # finished, with an error: wait() and exception() give it
            pass
        return True

    def exception(self):
        """The error this Work ended with, or None (as torch's Work)."""
        return self.error

    def result(self) -> list:
        """The tensors of the call, as torch's Work.result()."""
        self.wait()
        return [self.tensor]
