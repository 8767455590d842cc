"""Listening on exactly one address and port, with a clear error when it is taken: what every
store (torch's, microddp's, the roll call's) is handed as its socket."""

from __future__ import annotations

import errno
import socket

from ..errors import MicroDDPError


def bind(addr: str, port: int) -> socket.socket:
    """Listen on exactly `addr:port` (not every interface), with a clear error if it is taken."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((addr, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise MicroDDPError(
                f"port {port} on {addr} is already in use; pick another MASTER_PORT "
                "(or let `microddp run` choose a free one)"
            ) from None
        raise MicroDDPError(f"cannot listen on {addr}:{port}: {e.strerror}") from None
    sock.listen(512)
    return sock
