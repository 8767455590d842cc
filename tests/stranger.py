"""A stranger on the job's network (not a test module itself; tests/test_stranger.py starts it in
a namespace of its own). It reads "ADDR PORT" lines on stdin, one per listening port of the job,
and to each port opens connections that send nothing, half of microddp's handshake (or a few
bytes), and 64 KiB of garbage, and holds every one of them open until stdin closes. Then it
prints how many connections it opened and how many the other end closed.
"""

from __future__ import annotations

import os
import socket
import sys

HALF = 40  # bytes: less than the 64 of a handshake's answer, more than any header's length


def attack(addr: str, port: int) -> list[socket.socket]:
    held = []
    for payload in (b"", b"half", os.urandom(1 << 16)):
        try:
            s = socket.create_connection((addr, port), timeout=5)
            if payload == b"half":
                s.settimeout(1)
                try:
                    s.recv(64)  # microddp's store greets first; others say nothing
                except OSError:
                    pass
                payload = os.urandom(HALF)
            if payload:
                s.sendall(payload)
            held.append(s)
        except OSError:
            pass  # the port went away (a group's listener closed) or refused us
    return held


def main() -> None:
    held: list[socket.socket] = []
    ports = set()
    for line in sys.stdin:
        addr, port = line.split()
        ports.add((addr, port))
        held += attack(addr, int(port))
    closed = 0
    for s in held:
        s.setblocking(False)
        try:
            closed += s.recv(1 << 16) == b""
        except OSError:
            pass  # still open (nothing to read), or reset
        s.close()
    print(f"stranger: {len(held)} connections to {len(ports)} ports, {closed} closed by the job",
          flush=True)


if __name__ == "__main__":
    main()
