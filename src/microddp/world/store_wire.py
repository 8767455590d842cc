"""The bytes between microddp's rendezvous store and its clients, after the handshake.

A request is one frame: a 4-byte length, an operation code, then fields, each a 4-byte length
and its bytes; an answer is a frame of a status byte and fields. Keys and values stay bytes from
end to end: nothing a peer sends is ever unpickled or evaluated, and a frame larger than
MAX_FRAME is refused before it is read.
"""

from __future__ import annotations

import socket
import struct

MAX_FRAME = 1 << 30  # one store value larger than this is not rendezvous data
_LEN = struct.Struct("!I")

SET, GET, ADD, CAS, DELETE, NUM_KEYS, CHECK, WAIT, MULTI_GET, MULTI_SET, APPEND, LIST = range(12)
OK, TIMEOUT, BAD = range(3)


class WireError(ConnectionError):
    """The other end closed the connection or sent a frame that breaks the format."""


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly `n` bytes from `sock`, or WireError if it closes first."""
    parts, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise WireError("connection closed")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def encode(head: int, fields: list[bytes]) -> bytes:
    """One frame: `head` (an operation or a status) and its fields."""
    body = bytearray([head])
    for f in fields:
        body += _LEN.pack(len(f))
        body += f
    return _LEN.pack(len(body)) + bytes(body)


def decode(body: bytes) -> tuple[int, list[bytes]]:
    """(head, fields) of a frame's body; WireError if the lengths do not add up."""
    if not body:
        raise WireError("empty frame")
    fields, at = [], 1
    while at < len(body):
        if at + 4 > len(body):
            raise WireError("a field's length is cut short")
        (n,) = _LEN.unpack_from(body, at)
        at += 4
        if at + n > len(body):
            raise WireError("a field is longer than its frame")
        fields.append(body[at:at + n])
        at += n
    return body[0], fields


def send_frame(sock: socket.socket, head: int, fields: list[bytes]) -> None:
    """Send one frame."""
    sock.sendall(encode(head, fields))


def recv_frame(sock: socket.socket) -> tuple[int, list[bytes]]:
    """Receive one frame, refusing one longer than MAX_FRAME before reading it."""
    (n,) = _LEN.unpack(recv_exact(sock, 4))
    if n > MAX_FRAME:
        raise WireError(f"a frame of {n} bytes is over the limit of {MAX_FRAME}")
    return decode(recv_exact(sock, n))
